"""Liveness end to end: stopped, killed and slow engines.

Real faults: SIGSTOP (the process keeps its socket and answers nothing), SIGKILL (the port
refuses), and a /health that answers slowly. Spec section "Liveness". The monitor's schedule
(a pass every interval, a slow pass delays the next and never overlaps it, `started_at`) runs
in virtual time in tests/scenario/test_monitor_schedule.py.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest

from narwhal.fleet.events import Event
from narwhal.fleet.reducer import Step
from narwhal.fleet.state import EngineState
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ("--role", "prefill", "--kv-role", "kv_producer")
DECODE = ("--role", "decode", "--kv-role", "kv_consumer")


def pd_fleet(prefill: SimProcess, *decodes: SimProcess) -> list[dict[str, Any]]:
    return [{"id": "p0", "url": prefill.url, "role": "prefill"}] + [
        {"id": f"d{i}", "url": d.url, "role": "decode"} for i, d in enumerate(decodes)
    ]


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def engine(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> dict[str, Any]:
    body = await get_json(http, rr.url + "/admin/engines")
    return next(e for e in body["engines"] if e["id"] == engine_id)


class Status(int):
    """An answer's status that shows its body in a failed comparison's message."""

    body: bytes

    def __repr__(self) -> str:
        return f"{int(self)} {self.body[:200]!r}"


async def complete(http: aiohttp.ClientSession, rr: RunningRouter) -> Status:
    body = {"model": "demo-model", "prompt": "are you alive", "max_tokens": 3}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        status = Status(resp.status)
        status.body = await resp.read()
        return status


class MissLog:
    """One engine's (liveness misses, ejected) after every change the router applies to it,
    from the fleet's observer: every state is seen, however briefly it lasts. (Sampling every
    5 ms missed a count of 2 that the next pass's quick 200 reset within a few milliseconds.)"""

    def __init__(self, rr: RunningRouter, engine_id: str) -> None:
        state = rr.router.fleet.get(engine_id)
        self.samples: list[tuple[int, bool]] = [(state.liveness_misses, state.ejected is not None)]
        self._engine_id = engine_id
        self._stopped = False
        rr.router.fleet.observe(self._seen)

    def _seen(self, before: EngineState, after: EngineState, event: Event, step: Step) -> None:
        if self._stopped or after.id != self._engine_id:
            return
        sample = (after.liveness_misses, after.ejected is not None)
        if sample != self.samples[-1]:
            self.samples.append(sample)

    def misses_before_ejection(self) -> list[int]:
        return sorted({m for m, ejected in self.samples if not ejected})

    def stop(self) -> None:
        self._stopped = True


# Liveness is the subject here: the connection/timeout streaks of the same sweeps must not
# eject first, so eject_after is set above liveness_misses.
LIVENESS = {"liveness_misses": 3, "eject_after": 20}
HEALTH_TIMEOUT_S = 0.4
FAST_HEALTH = {"health_timeout_s": HEALTH_TIMEOUT_S}


@pytest.mark.slow
async def test_a_stopped_engine_is_ejected_after_liveness_misses_silent_sweeps(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, d0, d1 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    rr = await start_router(pd_fleet(prefill, d0, d1), recovery=LIVENESS, engine=FAST_HEALTH)
    await eventually(lambda: rr.router.monitor.status.passes >= 2, what="two passes")
    log = MissLog(rr, "d1")
    frozen_at = time.monotonic()
    d1.freeze()
    try:
        record = await eventually(lambda: _ejected(http, rr, "d1"), timeout_s=10, what="d1 ejected")
    finally:
        elapsed = time.monotonic() - frozen_at
        log.stop()
    assert record["cause"] == "liveness"
    # Ejected only once the counter reached the limit: 1 and 2 were seen without ejection.
    assert log.misses_before_ejection() == [0, 1, 2]
    assert elapsed >= 2 * HEALTH_TIMEOUT_S, "three silent sweeps need at least two health timeouts"
    # The other engines' counters are their own.
    for other in ("p0", "d0"):
        state = await engine(http, rr, other)
        assert state["liveness_misses"] == 0 and state["ejected"] is False
    # Requests keep succeeding on the live decode engine.
    assert [await complete(http, rr) for _ in range(4)] == [200] * 4

    # Thawed, the engine answers again and the readmission pipeline returns it.
    d1.thaw()

    async def back() -> bool:
        state = await engine(http, rr, "d1")
        return state["ejected"] is False and state["liveness_misses"] == 0

    await eventually(back, timeout_s=10, what="d1 readmitted after thaw")


async def _ejected(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> Any:
    return (await engine(http, rr, engine_id))["ejection"]


async def test_a_killed_engine_is_ejected_after_liveness_misses_silent_sweeps(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, d0, d1 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    rr = await start_router(pd_fleet(prefill, d0, d1), recovery=LIVENESS, engine=FAST_HEALTH)
    await eventually(lambda: rr.router.monitor.status.passes >= 2, what="two passes")
    log = MissLog(rr, "d1")
    d1.kill()
    record = await eventually(lambda: _ejected(http, rr, "d1"), timeout_s=10, what="d1 ejected")
    log.stop()
    assert record["cause"] == "liveness"
    assert log.misses_before_ejection() == [0, 1, 2]
    assert [await complete(http, rr) for _ in range(4)] == [200] * 4


@pytest.mark.slow
async def test_a_slow_health_within_the_timeout_is_never_a_miss(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, d0, d1 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    # /health on d1 takes 150 ms; the health timeout is 600 ms.
    d1.add_fault({"kind": "health_hang", "delay_s": 0.15})
    rr = await start_router(
        pd_fleet(prefill, d0, d1),
        recovery={"liveness_misses": 1, "eject_after": 1},
        engine={"health_timeout_s": 0.6},
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 8, timeout_s=10, what="8 passes")
    state = await engine(http, rr, "d1")
    assert state["ejected"] is False
    assert state["liveness_misses"] == 0
    assert set(state["evidence"].values()) == {0}
    assert state["eligible"] is True
    assert [await complete(http, rr) for _ in range(4)] == [200] * 4


@pytest.mark.slow
async def test_any_successful_health_response_resets_the_miss_counter(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, d0, d1 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    rr = await start_router(
        pd_fleet(prefill, d0, d1),
        recovery={"liveness_misses": 4, "eject_after": 20},
        engine=FAST_HEALTH,
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 2, what="two passes")
    fleet = rr.router.fleet

    d1.freeze()
    await eventually(lambda: fleet.get("d1").liveness_misses >= 2, timeout_s=5, what="two misses")
    d1.thaw()
    await eventually(lambda: fleet.get("d1").liveness_misses == 0, timeout_s=5, what="reset")
    assert fleet.get("d1").ejected is None

    # After the reset, a new outage needs the full count again (1, 2, 3 seen, then ejection).
    log = MissLog(rr, "d1")
    d1.freeze()
    try:
        record = await eventually(lambda: _ejected(http, rr, "d1"), timeout_s=10, what="d1 ejected")
    finally:
        d1.thaw()
        log.stop()
    assert record["cause"] == "liveness"
    assert log.misses_before_ejection() == [0, 1, 2, 3]


@pytest.mark.slow
async def test_health_hang_count_then_200_resets_the_counter_without_ejection(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Two silent sweeps (health hangs past the timeout), one 200, two more: never 3 in a row."""
    prefill, d0, d1 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    rr = await start_router(
        pd_fleet(prefill, d0, d1),
        recovery={"liveness_misses": 3, "eject_after": 20},
        engine=FAST_HEALTH,
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="first pass")
    log = MissLog(rr, "d1")
    for _ in range(2):
        start = len(log.samples)
        d1.add_fault({"kind": "health_hang", "delay_s": 1.0, "count": 2})

        def two_then_reset(start: int = start) -> bool:
            misses = [m for m, _ in log.samples[start:]]
            return 2 in misses and misses[-1] == 0 and misses.index(2) < len(misses) - 1

        await eventually(two_then_reset, timeout_s=15, what="two misses, then a reset")
    log.stop()
    assert rr.router.fleet.get("d1").ejected is None
    assert max(m for m, _ in log.samples) == 2


# With the defaults (recovery.eject_after 3 = recovery.liveness_misses 3) the health stage's
# evidence and the liveness counter reach 3 on the same sweep; the health stage runs first
# (docs/monitor.md, "Which stage ejects").


async def test_with_defaults_a_killed_engine_is_ejected_for_connection(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Refused health checks are `connection` evidence, which ejects at once at its limit: the
    health stage ejects before the liveness stage of the same pass counts the third miss."""
    prefill, d0, d1 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    rr = await start_router(pd_fleet(prefill, d0, d1), engine=FAST_HEALTH)
    assert rr.router.config.recovery.eject_after == rr.router.config.recovery.liveness_misses
    await eventually(lambda: rr.router.monitor.status.passes >= 2, what="two passes")
    d1.kill()
    record = await eventually(lambda: _ejected(http, rr, "d1"), timeout_s=10, what="d1 ejected")
    assert record["cause"] == "connection", record
    assert record["evidence"]["connection"] == rr.router.config.recovery.eject_after
    # The ejected engine's misses stop being counted: the liveness stage skips it.
    assert (await engine(http, rr, "d1"))["liveness_misses"] < 3


@pytest.mark.slow
async def test_with_defaults_a_stopped_engine_is_ejected_for_liveness(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Timed-out health checks are `timeout` evidence, whose limit only schedules a suspect
    health probe (in the background, up to a health timeout): the liveness stage of the same
    pass ejects first."""
    prefill, d0, d1 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    rr = await start_router(pd_fleet(prefill, d0, d1), engine=FAST_HEALTH)
    await eventually(lambda: rr.router.monitor.status.passes >= 2, what="two passes")
    d1.freeze()
    try:
        record = await eventually(lambda: _ejected(http, rr, "d1"), timeout_s=10, what="d1 ejected")
    finally:
        d1.thaw()
    assert record["cause"] == "liveness", record
