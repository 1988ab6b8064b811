"""Lease renewal and takeover in virtual time (DESIGN §5, docs/lease.md): two routers'
real `Ownership` loops over one in-memory lease store and one fake clock.

router-a holds the lease and renews every `renew_interval_s`; router-b is its standby and
steps every `monitor_interval_s`. Every half second of virtual time both are asked whether
they admit (what `/ready` would say), so the bounds are exact instants, not a real-time
window, and "never both" is checked at every sample. tests/e2e/test_lease_failover.py runs
the same rules as processes with real faults (SIGKILL, SIGSTOP, etcd down, a stuck flock).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from narwhal.clock import FakeClock
from narwhal.control.ownership import Ownership
from narwhal.state.lease import FENCED_LINE, Role
from tests.support.ownership import ACTIVE_URL, make_ownership
from tests.unit.test_lease_keeper import MemoryLeaseStore

T0 = 1000.0
TTL_S = 10.0
RENEW_S = 2.0
DEADLINE_S = 7.5  # the derived default renew deadline: 0.75 x ttl_s
STEP_S = 1.0  # the standby's step: controller.monitor_interval_s
THRESHOLD = 3
SAMPLE_S = 0.5
DEGRADED = (503, "monitoring degraded: handoff OSError")


class ActiveReady:
    """router-a's `/ready` as router-b's probe sees it."""

    def __init__(self) -> None:
        self.answer: tuple[int, str] | None = (200, "ready")

    async def __call__(self, url: str) -> tuple[int, str] | None:
        assert url == ACTIVE_URL
        return self.answer


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since T0
    a: str | None  # router-a's admission reason (None: admitting)
    b: str | None
    b_failures: int
    b_epoch: int | None


@dataclass
class Pair:
    clock: FakeClock
    store: MemoryLeaseStore
    a: Ownership
    b: Ownership
    a_loop: asyncio.Task[None]

    async def watch(self, seconds: float) -> list[Sample]:
        """Run both loops for `seconds`, sampling both routers every `SAMPLE_S`."""
        samples = []
        for _ in range(round(seconds / SAMPLE_S)):
            await self.clock.run_for(SAMPLE_S)
            now = self.clock.monotonic()
            samples.append(
                Sample(
                    now - T0,
                    self.a.keeper.admission_reason(now),
                    self.b.keeper.admission_reason(now),
                    self.b.active_failures,
                    self.b.keeper.epoch,
                )
            )
        assert not [s for s in samples if s.a is None and s.b is None], "both admitted"
        return samples

    async def stop_a(self) -> None:
        """router-a renews no more (killed, or frozen): its loop is gone."""
        self.a_loop.cancel()
        await asyncio.gather(self.a_loop, return_exceptions=True)


@asynccontextmanager
async def pair(tmp_path: Path, ready: ActiveReady | None = None) -> AsyncIterator[Pair]:
    """router-a active from T0 (renewing), router-b its standby; with `ready`, router-b
    counts router-a's failing `/ready` toward the takeover threshold."""
    clock = FakeClock(monotonic=T0)
    store = MemoryLeaseStore(clock)
    lease = {"ttl_s": TTL_S, "renew_interval_s": RENEW_S}
    a, b = (
        make_ownership(
            tmp_path,
            name,
            store,
            clock,
            monitor_interval_s=STEP_S,
            lease=lease,
            takeover_threshold=THRESHOLD,
            probe_ready=probe,
        )
        for name, probe in (("router-a", None), ("router-b", ready))
    )
    await a.start(standby=False)
    await b.start(standby=True)
    assert (a.keeper.role, b.keeper.role) == (Role.ACTIVE, Role.STANDBY)
    loops = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:
        await clock.settle()
        yield Pair(clock, store, a, b, loops[0])
    finally:
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


def first(samples: list[Sample], what: str, cond: Callable[[Sample], bool]) -> float:
    """When `cond` first held (seconds since T0)."""
    found = next((s.t for s in samples if cond(s)), None)
    assert found is not None, f"never {what}"
    return found


async def test_the_holder_renews_every_interval_and_keeps_the_lease(tmp_path: Path) -> None:
    async with pair(tmp_path) as p:
        samples = await p.watch(120.0)
        assert all(s.a is None for s in samples)
        assert all(s.b == "standby: lease held by router-a" for s in samples)
        assert p.store.log.count("renew") == 61  # at T0, T0 + 2, ..., T0 + 120
        assert p.store.log.count("swap") == 1  # router-a's acquisition; router-b never tried
        assert (p.a.keeper.role, p.a.keeper.epoch) == (Role.ACTIVE, 1)
        assert p.b.keeper.role is Role.STANDBY
        record = p.store.record
        assert record is not None and record.expires_at == p.clock.wall() + TTL_S


async def test_a_stopped_renewal_lets_the_standby_take_over_after_the_ttl(tmp_path: Path) -> None:
    async with pair(tmp_path) as p:
        await p.clock.run_for(5.0)  # renewals at T0, T0 + 2, T0 + 4
        await p.stop_a()
        samples = await p.watch(20.0)
        last_renewal = 4.0
        # router-a judges its own lease from the start of its last renewal: it stops
        # admitting at the renew deadline, before the lease it stamped expires.
        assert first(samples, "a stops", lambda s: s.a is not None) == last_renewal + DEADLINE_S
        assert {s.a for s in samples if s.a is not None} == {FENCED_LINE}
        # router-b sees the record expire at its step at that instant, takes it and admits
        # at once (an expired lease is not waited out).
        taken = first(samples, "b takes over", lambda s: s.b_epoch == 2)
        assert taken == last_renewal + TTL_S
        assert first(samples, "b admits", lambda s: s.b is None) == taken
        assert all(s.b is None for s in samples if s.t >= taken)
        assert p.b.keeper.role is Role.ACTIVE


async def test_a_degraded_active_is_preempted_at_the_threshold_not_before(tmp_path: Path) -> None:
    ready = ActiveReady()
    async with pair(tmp_path, ready) as p:
        await p.clock.run_for(10.5)
        assert p.b.active_failures == 0  # router-a was ready at every check so far
        ready.answer = DEGRADED  # router-a still renews; its monitor is what failed
        samples = await p.watch(20.0)
        # One failing check per step (T0 + 11, + 12), the takeover at the THRESHOLD-th.
        before = [s for s in samples if s.b_epoch is None]  # router-b holds no epoch yet
        assert [(s.t, s.b_failures) for s in before if s.t == int(s.t)] == [(11.0, 1), (12.0, 2)]
        taken = first(samples, "b takes over", lambda s: s.b_epoch == 2)
        assert taken == 10.0 + THRESHOLD
        # A live lease was preempted: router-b waits out the one router-a last stamped (its
        # renewal at T0 + 12), and router-a fences at its next renewal (T0 + 14).
        assert first(samples, "a fenced", lambda s: s.a == FENCED_LINE) == 14.0
        assert first(samples, "b admits", lambda s: s.b is None) == 12.0 + TTL_S
        assert {s.b for s in samples if taken <= s.t < 22.0} == {
            "standby: waiting out the previous lease"
        }
        assert p.a.keeper.role is Role.FENCED
        assert p.a.keeper.fence_reason


async def test_work_started_while_leading_is_cancelled_when_the_holder_fences(
    tmp_path: Path,
) -> None:
    """Probes, readmission attempts and rebalancing verifications go through
    `Ownership.spawn`: they run in the leadership scope, so the fencing that ends a holder's
    lease cancels them; a router that does not lead starts nothing."""
    ready = ActiveReady()
    async with pair(tmp_path, ready) as p:
        cancelled = asyncio.Event()

        async def probe() -> None:  # a probe against an engine that never answers
            try:
                await asyncio.get_running_loop().create_future()
            finally:
                cancelled.set()

        task = p.a.spawn(probe())
        assert task is not None
        refused = probe()
        assert p.b.spawn(refused) is None  # the standby starts nothing...
        assert refused.cr_frame is None  # ...and closes the work unstarted
        await p.clock.run_for(10.5)
        assert not task.done()
        ready.answer = DEGRADED
        await p.watch(20.0)  # preempted at T0 + 13; router-a fences at T0 + 14
        assert p.a.keeper.role is Role.FENCED
        assert task.cancelled() and cancelled.is_set()
        heir = p.b.spawn(asyncio.sleep(0))
        assert heir is not None
        await heir
