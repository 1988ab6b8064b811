"""The `readmission` stage's schedule on a fake clock (DESIGN §2, §3; spec "Readmission and
drains").

Ejected engines and engines under planned maintenance are retried with exponential backoff
(capped, jittered by an injected random source); an operator drain alone is never retried; a
failure quarantine waits for its deadline. The stage only starts attempts: one per engine at a
time, each applied when it ends (a slow engine never holds up the pass). A result overtaken by
events (maintenance requested, or the engine readmitted, while it ran) is discarded.

The pipeline itself is replaced by a scripted fake (`ScriptedReadmission.verify`); attempts
are collected instead of spawned, and the test finishes each one when it chooses.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from narwhal.clock import FakeClock
from narwhal.config import parse_config
from narwhal.control.readmission import Readmission, StepResult, attempt_due
from narwhal.fleet.holds import HoldName
from narwhal.fleet.state import EngineState
from narwhal.server import Router
from tests.support.fleet import collecting_tasks
from tests.support.router import router_config

INTERVAL_S = 1.0
QUARANTINE_S = 20.0
ENGINES = [
    {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
    {"id": "p1", "url": "http://127.0.0.1:2", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:3", "role": "decode"},
]
PASSED = [StepResult("health", True, "health 200"), StepResult("final_health", True, "ok")]
FAILED = [StepResult("health", False, "connect failed")]


class LowRandom(random.Random):
    """Always the lowest draw: every wait is exactly half its delay."""

    def random(self) -> float:
        return 0.0


class ScriptedReadmission(Readmission):
    """The real schedule and apply; `verify` answers what the test scripts, when it says."""

    def __init__(self, router: Router, clock: FakeClock) -> None:
        super().__init__(
            router.config,
            router.fleet,
            router.client,
            router.lifecycle,
            router.metrics,
            LowRandom(0),
            router.prober,
            router.adapters,
            clock,
        )
        self.outcomes: asyncio.Queue[list[StepResult]] = asyncio.Queue()
        self.verified: list[str] = []

    async def verify(self, engine: EngineState) -> list[StepResult]:
        self.verified.append(engine.id)
        results = await self.outcomes.get()
        self.last_results[engine.id] = results
        return results


class Rig:
    def __init__(self, tmp_path: Path, **recovery: Any) -> None:
        config = parse_config(
            router_config(
                ENGINES, tmp_path, controller={"monitor_interval_s": INTERVAL_S}, recovery=recovery
            )
        )
        self.clock = FakeClock()
        self.router = Router(config, clock=self.clock)
        self.readmission = ScriptedReadmission(self.router, self.clock)
        self.started: list[asyncio.Task[None]] = []
        self.tasks = collecting_tasks(self.started)

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def e(self, engine_id: str) -> EngineState:
        return self.router.fleet.get(engine_id)

    def eject(self, engine_id: str) -> None:
        self.router.lifecycle.eject(self.e(engine_id), "connection", "test", self.now)

    def run_stage(self) -> int:
        """One `readmission` stage; returns how many attempts it started."""
        before = len(self.started)
        self.readmission.schedule(self.now, self.tasks)
        return len(self.started) - before

    async def finish(self, results: list[StepResult]) -> None:
        """Let the oldest running attempt end with `results`."""
        await self.readmission.outcomes.put(results)
        await self.started.pop(0)

    async def close(self) -> None:
        """Cancel the attempts the test did not finish."""
        for task in self.started:
            task.cancel()
        await asyncio.gather(*self.started, return_exceptions=True)


@pytest.fixture
async def rig(tmp_path: Path) -> Any:
    r = Rig(tmp_path)
    yield r
    await r.close()


async def test_failed_attempts_back_off_exponentially_up_to_the_cap(rig: Rig) -> None:
    rig.eject("p0")
    assert rig.run_stage() == 1  # the first attempt: at once
    waits: list[float] = []
    for _ in range(8):
        await rig.finish(FAILED)
        waited = 0.0  # step the fake clock pass by pass until the next attempt starts
        while not rig.run_stage():
            rig.clock.advance(0.25)
            waited += 0.25
        waits.append(waited)
    # base 1 s doubling, cap 30 s; the lowest draw waits half the delay
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0]


async def test_one_attempt_per_engine_at_a_time_and_none_while_quarantined(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, failure_quarantine_s=QUARANTINE_S)
    try:
        rig.eject("p0")  # ejection adds a failure quarantine
        assert rig.run_stage() == 0
        rig.clock.advance(QUARANTINE_S)
        assert rig.run_stage() == 1
        rig.clock.advance(60)
        assert rig.run_stage() == 0  # the first attempt is still running
        await rig.finish(PASSED)
        assert rig.e("p0").ejected is None and rig.e("p0").holds == {}
        assert rig.readmission.verified == ["p0"]
    finally:
        await rig.close()


async def test_a_drain_alone_is_never_retried_and_success_resets_the_backoff(rig: Rig) -> None:
    rig.router.operator.drain("p1")
    rig.clock.advance(100)
    assert rig.run_stage() == 0

    rig.eject("p0")
    assert rig.run_stage() == 1
    await rig.finish(FAILED)
    rig.clock.advance(0.5)
    assert rig.run_stage() == 1
    await rig.finish(FAILED)
    rig.clock.advance(1.0)
    assert rig.run_stage() == 1
    await rig.finish(PASSED)
    assert rig.e("p0").ejected is None
    rig.eject("p0")  # out again: the first retry is immediate, the count starts over
    assert rig.run_stage() == 1
    await rig.finish(FAILED)
    rig.clock.advance(0.49)
    assert rig.run_stage() == 0
    rig.clock.advance(0.01)
    assert rig.run_stage() == 1


async def test_planned_maintenance_is_retried_and_its_success_clears_the_hold(rig: Rig) -> None:
    rig.router.lifecycle.hold(
        rig.e("p0"), HoldName.PLANNED_MAINTENANCE, "maintenance", rig.now, newer_than=100.0
    )
    assert rig.run_stage() == 1
    await rig.finish(FAILED)
    assert HoldName.PLANNED_MAINTENANCE in rig.e("p0").holds
    rig.clock.advance(0.5)
    assert rig.run_stage() == 1
    await rig.finish(PASSED)
    assert rig.e("p0").holds == {} and rig.router.fleet.eligible(rig.e("p0"), rig.now)


async def test_maintenance_requested_during_an_attempt_discards_its_success(rig: Rig) -> None:
    rig.eject("p0")
    assert rig.run_stage() == 1
    rig.router.lifecycle.hold(
        rig.e("p0"), HoldName.PLANNED_MAINTENANCE, "maintenance", rig.now, newer_than=100.0
    )
    await rig.finish(PASSED)  # verified before the baseline existed: not good enough
    assert rig.e("p0").ejected is not None
    assert HoldName.PLANNED_MAINTENANCE in rig.e("p0").holds
    assert rig.run_stage() == 1  # the next pass tries again, against the baseline


async def test_an_engine_readmitted_by_the_operator_meanwhile_is_left_alone(rig: Rig) -> None:
    rig.eject("p0")
    assert rig.run_stage() == 1
    rig.router.lifecycle.readmit(rig.e("p0"), "operator", rig.now, operator=True)
    await rig.finish(FAILED)
    assert rig.e("p0").ejected is None
    rig.clock.advance(100)
    assert rig.run_stage() == 0


@pytest.mark.parametrize(
    ("state", "next_try", "running", "due"),
    [
        ("in_service", None, False, False),
        ("drained", None, False, False),
        ("ejected", None, False, True),
        ("ejected", 1001.0, False, False),  # backoff not over (now is 1000)
        ("ejected", 1000.0, False, True),
        ("ejected", None, True, False),  # one attempt at a time
        ("maintenance", None, False, True),
        ("quarantined", None, False, False),
        ("quarantine_expired", None, False, True),
    ],
)
def test_attempt_due(
    tmp_path: Path, state: str, next_try: float | None, running: bool, due: bool
) -> None:
    rig = Rig(tmp_path, failure_quarantine_s=QUARANTINE_S)
    now = rig.now
    lifecycle = rig.router.lifecycle
    if state == "drained":
        lifecycle.hold(rig.e("p0"), HoldName.OPERATOR_DRAIN, "x", now)
    elif state == "maintenance":
        lifecycle.hold(rig.e("p0"), HoldName.PLANNED_MAINTENANCE, "x", now)
    elif state in ("ejected", "quarantined", "quarantine_expired"):
        rig.eject("p0")
        assert HoldName.FAILURE_QUARANTINE in rig.e("p0").holds
        if state == "ejected":  # ejected without the quarantine that comes with it
            lifecycle.release(rig.e("p0"), HoldName.FAILURE_QUARANTINE, "test", now)
        elif state == "quarantine_expired":
            rig.clock.advance(QUARANTINE_S)
            now = rig.now
            next_try = None if next_try is None else next_try + QUARANTINE_S
    assert attempt_due(rig.e("p0"), now, next_try, running) is due
