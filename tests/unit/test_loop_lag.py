"""The loop-lag watcher: a blocked loop shows in both histograms, a thread that waited for a
CPU only in the lag one (the kernel's run-queue wait, faked here, is subtracted)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from narwhal.telemetry.loop_lag import LAG_BUCKETS_S, run_queue_wait_s, watch_loop_lag


def _histograms() -> tuple[CollectorRegistry, Histogram, Histogram]:
    r = CollectorRegistry()
    lag = Histogram("lag_seconds", "lag", registry=r, buckets=LAG_BUCKETS_S)
    stall = Histogram("stall_seconds", "stall", registry=r, buckets=LAG_BUCKETS_S)
    return r, lag, stall


def _over(r: CollectorRegistry, name: str, bound: float) -> float:
    count = r.get_sample_value(f"{name}_count") or 0.0
    return count - (r.get_sample_value(f"{name}_bucket", {"le": str(bound)}) or 0.0)


def _block_the_loop(seconds: float) -> None:
    """The fault: a blocking call on the event loop's thread."""
    time.sleep(seconds)


def _growing_by(step_s: float) -> Callable[[], float]:
    """A run-queue wait that grows by `step_s` at each read: a thread kept off the CPU."""
    waited = [0.0]

    def read() -> float:
        waited[0] += step_s
        return waited[0]

    return read


async def _watch_through_a_block(waited: Callable[[], float | None]) -> CollectorRegistry:
    """Run the watcher while the loop is blocked for 0.2 s."""
    r, lag, stall = _histograms()
    task = asyncio.create_task(watch_loop_lag(lag, stall, interval_s=0.01, waited=waited))
    await asyncio.sleep(0.03)
    _block_the_loop(0.2)
    await asyncio.sleep(0.03)
    task.cancel()
    return r


async def test_a_blocked_loop_is_a_stall() -> None:
    r = await _watch_through_a_block(_growing_by(0.0))
    assert _over(r, "lag_seconds", 0.1) == 1
    assert _over(r, "stall_seconds", 0.1) == 1


async def test_lateness_spent_waiting_for_a_cpu_is_lag_but_not_a_stall() -> None:
    # Each wake-up's interval counts a second of run-queue wait: more than any lateness.
    r = await _watch_through_a_block(_growing_by(1.0))
    assert _over(r, "lag_seconds", 0.1) == 1
    assert _over(r, "stall_seconds", 0.001) == 0


async def test_without_schedstat_a_stall_is_the_whole_lateness() -> None:
    r = await _watch_through_a_block(lambda: None)
    assert _over(r, "stall_seconds", 0.1) == _over(r, "lag_seconds", 0.1) == 1


def test_the_kernel_counts_this_threads_wait() -> None:
    waited = run_queue_wait_s()
    assert waited is not None and waited >= 0.0  # Linux keeps schedstat (the tests' host)
