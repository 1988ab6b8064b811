"""The monitor loop's schedule in virtual time (DESIGN §3, §8.4): `run_forever` on a fake
clock, with test stages that may take (virtual) time or raise.

A pass every interval from the previous pass's start; a slow pass delays the next and never
overlaps it; `started_at` is the pass's start; a standby runs none; a failure streak at the
limit degrades `/ready` at the pass that reaches it, and one clean pass restores it. The
same checks over real sockets used to wait real seconds (tests/e2e/test_monitor_liveness.py
keeps the ones whose subject is a real engine fault).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from narwhal.clock import FakeClock
from narwhal.control.monitor import STAGE_ORDER, Monitor, Stage
from narwhal.fleet.admission import Admission
from narwhal.fleet.readiness import ready_reason
from narwhal.telemetry.metrics import Metrics

T0 = 1000.0
WALL0 = 1_800_000_000.0
INTERVAL_S = 10.0
LIMIT = 3


@dataclass
class Stages:
    """Test stages: `health` takes `health_s` of virtual time; `handoff` raises while
    `failing`. `inside` counts passes between their first and last stage."""

    clock: FakeClock
    health_s: float = 0.0
    failing: bool = False
    inside: int = 0
    most_inside: int = 0
    starts: list[float] = field(default_factory=list)  # the `now` each pass was given

    def build(self) -> dict[str, Stage]:
        stages: dict[str, Stage] = {name: self._plain for name in STAGE_ORDER}
        stages["controller"] = self._first
        stages["health"] = self._health
        stages["handoff"] = self._last
        return stages

    async def _plain(self, now: float) -> None:
        return None

    async def _first(self, now: float) -> None:
        self.starts.append(now)
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)

    async def _health(self, now: float) -> None:
        if self.health_s:
            await self.clock.sleep(self.health_s)

    async def _last(self, now: float) -> None:
        self.inside -= 1
        if self.failing:
            raise OSError("handoff directory gone")


@dataclass
class Rig:
    clock: FakeClock
    stages: Stages
    admission: Admission
    monitor: Monitor
    active: bool = True

    def ready(self) -> str | None:
        """What `/ready` says (the router's precedence, no engine roles involved)."""
        return ready_reason(self.admission.reason("lease"), self.admission.reason("monitor"), [])


@asynccontextmanager
async def running(health_s: float = 0.0) -> AsyncIterator[Rig]:
    """A monitor over test stages, its `run_forever` loop started at T0."""
    clock = FakeClock(monotonic=T0, wall=WALL0)
    stages = Stages(clock, health_s=health_s)
    admission = Admission()
    monitor = Monitor(stages.build(), LIMIT, admission, Metrics(), clock)
    rig = Rig(clock, stages, admission, monitor)
    loop = asyncio.create_task(monitor.run_forever(INTERVAL_S, should_run=lambda: rig.active))
    try:
        await clock.settle()
        yield rig
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_a_pass_runs_every_interval_without_drift() -> None:
    async with running() as rig:
        await rig.clock.run_for(100.0)
        assert rig.stages.starts == [T0 + i * INTERVAL_S for i in range(11)]
        stamps = [p.started_at for p in rig.monitor.status.history]
        assert stamps == [WALL0 + i * INTERVAL_S for i in range(11)]


async def test_a_pass_shorter_than_the_interval_keeps_the_pace_from_its_start() -> None:
    async with running(health_s=4.0) as rig:
        await rig.clock.run_for(30.0)
        assert rig.stages.starts == [T0, T0 + 10.0, T0 + 20.0, T0 + 30.0]


async def test_a_slow_pass_delays_the_next_and_never_overlaps_it() -> None:
    async with running(health_s=15.0) as rig:
        await rig.clock.run_for(60.0)
        # Each pass takes 15 s against a 10 s interval: the next starts when it ends.
        assert rig.stages.starts == [T0, T0 + 15.0, T0 + 30.0, T0 + 45.0, T0 + 60.0]
        assert rig.stages.most_inside == 1
        assert rig.monitor.status.passes == 4  # the fifth is still inside its health stage


async def test_started_at_is_when_the_pass_started_not_when_it_ended() -> None:
    async with running(health_s=4.0) as rig:
        await rig.clock.run_for(5.0)
        (report,) = rig.monitor.status.history
        assert report.started_at == WALL0
        health = next(s for s in report.stages if s.stage == "health")
        assert health.error is None


async def test_a_standby_runs_no_pass_until_it_is_active() -> None:
    async with running() as rig:
        rig.active = False
        await rig.clock.run_for(35.0)  # the pass at T0 ran before the flip
        assert rig.stages.starts == [T0]
        rig.active = True
        await rig.clock.run_for(10.0)
        assert rig.stages.starts == [T0, T0 + 40.0]


async def test_a_failure_streak_degrades_ready_at_the_limit_and_one_clean_pass_recovers() -> None:
    async with running() as rig:
        await rig.clock.run_for(5.0)
        assert rig.ready() is None and rig.admission.admitting
        rig.stages.failing = True  # from the pass at T0 + 10 on
        reason = "monitoring degraded: handoff OSError"
        seen: list[tuple[float, int, str | None]] = []
        for _ in range(4):  # up to T0 + 45: failing passes at +10, +20, +30, +40
            await rig.clock.run_for(INTERVAL_S)
            seen.append((rig.clock.monotonic(), rig.monitor.status.streak, rig.ready()))
        assert seen == [
            (T0 + 15.0, 1, None),
            (T0 + 25.0, 2, None),
            (T0 + 35.0, 3, reason),  # the LIMIT-th failing pass closes admission
            (T0 + 45.0, 4, reason),
        ]
        assert not rig.admission.admitting
        assert rig.monitor.to_json()["degraded"] == reason
        rig.stages.failing = False
        await rig.clock.run_for(INTERVAL_S)  # the pass at T0 + 50 succeeds
        assert (rig.monitor.status.streak, rig.ready()) == (0, None)
        assert rig.admission.admitting
