"""The health stage is not delayed by slow engines beyond the health timeout (issue 4: "the
pass must not be delayed by slow engines beyond the health timeout (probes run concurrently)").

Real faults on three `narwhal-sim` engines: a `/health` that hangs past the timeout, and a
`/metrics` that hangs (the router reads the process generation from it once an engine is
healthy). Each would cost the stage a timeout per engine if engines were asked one at a time;
read concurrently and bounded by `engine.health_timeout_s`, the stage's duration in
/admin/monitor stays near one health timeout.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]
HEALTH_TIMEOUT_S = 1.0
# Sequential checks of three engines would take 3 s; generous for a loaded 2-core machine.
STAGE_BOUND_S = HEALTH_TIMEOUT_S + 0.8
# Neither the sweeps' timeouts nor liveness may eject anyone during the test.
QUIET_RECOVERY = {"eject_after": 1000, "liveness_misses": 1000}


def _fleet(sims: list[SimProcess]) -> list[dict[str, Any]]:
    roles = ["prefill", "decode", "decode"]
    return [
        {"id": f"e{i}", "url": sim.url, "role": role}
        for i, (sim, role) in enumerate(zip(sims, roles, strict=True))
    ]


async def _health_durations(
    http: aiohttp.ClientSession, rr: RunningRouter, passes: int
) -> list[float]:
    """The health stage's duration in each of the next `passes` monitor passes."""
    async with http.get(rr.url + "/admin/monitor") as resp:
        start = (await resp.json())["passes"]

    async def later() -> dict[str, Any] | None:
        async with http.get(rr.url + "/admin/monitor") as resp:
            mon: dict[str, Any] = await resp.json()
        return mon if mon["passes"] >= start + passes else None

    mon = await eventually(later, timeout_s=30, interval_s=0.1, what=f"{passes} passes")
    fresh = [p for p in mon["last_passes"] if p["pass"] > start]
    return [s["duration_s"] for p in fresh for s in p["stages"] if s["stage"] == "health"]


async def test_engines_whose_health_hangs_are_checked_concurrently(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    sims = sim_factory.start_many([PREFILL, DECODE, DECODE])
    rr = await start_router(
        _fleet(sims), engine={"health_timeout_s": HEALTH_TIMEOUT_S}, recovery=QUIET_RECOVERY
    )
    for sim in sims:
        sim.add_fault({"kind": "health_hang", "delay_s": 30})
    await _health_durations(http, rr, 1)  # a pass that may have started before the faults
    durations = await _health_durations(http, rr, 3)
    assert durations and all(HEALTH_TIMEOUT_S * 0.9 <= d < STAGE_BOUND_S for d in durations), (
        durations
    )
    for engine in rr.router.fleet:
        assert engine.liveness_misses >= 3  # the checks did time out: silent sweeps


async def test_a_hanging_metrics_endpoint_does_not_stall_the_health_stage(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Healthy engines whose `/metrics` hangs: reading their process generation is cut off at
    the health timeout, concurrently, and asked again on later passes."""
    sims = sim_factory.start_many([PREFILL, DECODE, DECODE])
    for sim in sims:
        sim.add_fault({"kind": "metrics_hang", "delay_s": 30})
    rr = await start_router(
        _fleet(sims),
        engine={"health_timeout_s": HEALTH_TIMEOUT_S, "probe_timeout_s": 5.0},
        recovery=QUIET_RECOVERY,
    )
    durations = await _health_durations(http, rr, 3)
    assert durations and all(d < STAGE_BOUND_S for d in durations), durations
    for engine in rr.router.fleet:
        assert engine.generation is None  # never read: /metrics did not answer
        assert engine.liveness_misses == 0 and engine.ejected is None
    # Once /metrics answers, a later pass learns each generation.
    for sim in sims:
        sim.clear_faults()

    def learned() -> bool:
        return all(engine.generation is not None for engine in rr.router.fleet)

    await eventually(learned, timeout_s=15, what="generations learned")


async def test_one_hanging_engine_does_not_stop_the_others_from_being_learned(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Each healthy engine learns in its own task as soon as its check answers: waiting for
    the slowest check first would leave no time before the deadline on every pass."""
    sims = sim_factory.start_many([PREFILL, DECODE, DECODE])
    sims[0].add_fault({"kind": "health_hang", "delay_s": 30})
    rr = await start_router(
        _fleet(sims), engine={"health_timeout_s": HEALTH_TIMEOUT_S}, recovery=QUIET_RECOVERY
    )
    fleet = rr.router.fleet

    def learned() -> bool:
        return all(fleet.get(i).generation is not None for i in ("e1", "e2"))

    await eventually(learned, timeout_s=15, what="the healthy engines' generations")
    assert all(fleet.get(i).max_model_len is not None for i in ("e1", "e2"))
    assert fleet.get("e0").generation is None  # never healthy, never asked
    durations = await _health_durations(http, rr, 2)
    assert durations and all(d < STAGE_BOUND_S for d in durations), durations
