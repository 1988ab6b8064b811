"""Event-loop lag: how late the router's loop runs a callback that was due.

Every request, health check and lease renewal shares one event loop, so a blocking call or a
long pause anywhere delays them all; `/ready` answering late looks like a dead router to a
load balancer and to a standby. This task wakes every `interval_s` and records how much
later than asked it woke: the longest stall that happened since the last wake-up, bounded
below by the sampling interval. It measures the loop itself, so it reads the loop's clock
(not the injected one, which a test may freeze).

A late wake-up has two causes an operator treats differently: the router's own (a callback
that ran long, a blocking call) and the host's (the loop's thread ready to run but waiting
for a CPU, on a starved or overcommitted machine). The kernel counts the second per thread
(the run-queue wait in `/proc/thread-self/schedstat`), so the stall histogram gets the
lateness less that wait: the router's own share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Observer(Protocol):
    """A histogram, or several (`Observers`)."""

    def observe(self, amount: float) -> None: ...


class Observers:
    """One observation into each of several histograms (one loop exported under two names)."""

    def __init__(self, *histograms: Observer) -> None:
        self._histograms = histograms

    def observe(self, amount: float) -> None:
        for h in self._histograms:
            h.observe(amount)


def run_queue_wait_s() -> float | None:
    """How long, in seconds, the calling thread has waited, runnable, for a CPU since it
    started (the kernel's schedstat counts nanoseconds); None where the kernel does not keep
    it. A procfs read answers from memory: it never waits on a device."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


async def watch_loop_lag(
    lag: Observer,
    stall: Observer,
    interval_s: float = 0.05,
    waited: Callable[[], float | None] = run_queue_wait_s,
) -> None:
    """Observe each wake-up's lateness into `lag`, and the part of it that was not the
    thread waiting for a CPU into `stall`, until cancelled. Without schedstat (`waited`
    answers None) the two are the same."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        before = waited()
        await asyncio.sleep(interval_s)
        late = max(0.0, loop.time() - due)
        after = waited()
        starved = after - before if before is not None and after is not None else 0.0
        lag.observe(late)
        stall.observe(max(0.0, late - starved))
