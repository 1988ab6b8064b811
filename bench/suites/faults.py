"""Goodput under faults: the same load and the same fault schedule for every router.

Two prefill and two decode sims behind the tap (`bench.tap`), which timestamps every client
request each engine receives. Per run: a fresh router, `warm` seconds of load, the fault for
`fault_s` seconds, then `after` seconds of load. The load is a closed loop, half streaming.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench import web
from bench.context import REQUEST_TIMEOUT_S, Context
from bench.routers import Engines, Running
from bench.sims import SimFlags, SimFleet
from bench.suites.common import measure, run_spec, start_routers, tapped_fleet
from bench.suites.fault_plan import SCENARIOS, Scenario
from bench.tap_client import Tap

FLAGS = SimFlags(itl_ms=5.0, ttft_per_token_ms=0.05)
CONCURRENCY = 16
MAX_TOKENS = 16
QUIET_S = 1.0  # an engine is out of rotation once it got no client request for this long
# Narwhal's defaults, which the runs use (docs/configuration.md)
MONITOR_INTERVAL_S = 1.0
EJECT_AFTER = 3
DEADLINES = {
    "none": 0.0,
    "stream_idle_timeout_s": 5.0,
    "health_timeout_s": 1.0,
}


async def run(ctx: Context) -> dict[str, Any]:
    mode = ctx.mode
    rows: list[dict[str, Any]] = []
    async with tapped_fleet(ctx.model, FLAGS, ctx.logs) as (fleet, tap, engines):
        for scenario_name in mode.fault_scenarios:
            scenario = SCENARIOS[scenario_name]
            for name in mode.fault_routers:
                if not ctx.available(name):
                    continue
                routers = await start_routers(ctx, [name], engines)
                if name not in routers:
                    continue
                try:
                    row = await _one(ctx, scenario, routers[name], engines, fleet, tap)
                finally:
                    await routers[name].stop()
                    await restore(fleet)
                    await ctx.loadgen.reset()
                rows.append(row)
                ctx.log(
                    f"faults {scenario.name:16} {name:18} failed {row['failed']:4} "
                    f"hung {row['hung']:3} out {_s(row['out_of_rotation_s'])} "
                    f"back {_s(row['back_s'])}"
                )
    return {
        "concurrency": CONCURRENCY,
        "max_tokens": MAX_TOKENS,
        "itl_ms": FLAGS.itl_ms,
        "warm_s": mode.fault_warm_s,
        "fault_s": mode.fault_s,
        "after_s": mode.fault_after_s,
        "request_timeout_s": REQUEST_TIMEOUT_S,
        "quiet_s": QUIET_S,
        "monitor_interval_s": MONITOR_INTERVAL_S,
        "eject_after": EJECT_AFTER,
        "scenarios": {s: SCENARIOS[s].what for s in mode.fault_scenarios},
        "rows": rows,
    }


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:5.2f} s"


async def restore(fleet: SimFleet) -> None:
    """Every engine running, thawed and without faults again."""
    for sim in fleet.sims:
        if sim.proc is None:
            await fleet.start_one(sim)
        fleet.freeze(sim.name, False)
    await fleet.clear_faults()


async def _one(
    ctx: Context, scenario: Scenario, router: Running, engines: Engines, fleet: SimFleet, tap: Tap
) -> dict[str, Any]:
    mode = ctx.mode
    await tap.dump()  # forget the traffic before this run
    spec = run_spec(
        f"faults-{scenario.name}-{router.spec.name}",
        router,
        engines,
        ctx.model,
        concurrency=CONCURRENCY,
        max_requests=1_000_000,
        duration_s=mode.fault_warm_s + mode.fault_s + mode.fault_after_s,
        stream="mixed",
        max_tokens=MAX_TOKENS,
        records=True,
    )
    task = asyncio.create_task(measure(ctx, router, spec))
    await asyncio.sleep(mode.fault_warm_s)
    t_fault = time.monotonic()
    await scenario.begin(fleet, scenario.engine)
    await asyncio.sleep(mode.fault_s)
    await scenario.end(fleet, scenario.engine)
    t_end = time.monotonic()
    m = await task
    arrivals = sorted((await tap.dump())["marked"].get(scenario.engine, []))
    return {
        "scenario": scenario.name,
        "router": router.spec.name,
        **judge(m.result.records, arrivals, t_fault, t_end, scenario),
        "throughput": m.result.throughput,
        "router_cpu_s": m.router_cpu_s,
        **(await _migrations(router) if router.spec.kind == "narwhal" else {}),
    }


async def _migrations(router: Running) -> dict[str, Any]:
    """Narwhal's streams continued elsewhere in the run, and the pause their clients saw
    (`narwhal_migration_gap_seconds`: p50 and p99 as bucket upper bounds)."""
    url = router.url + "/metrics"
    gap = await web.histogram(url, "narwhal_migration_gap_seconds")
    return {
        "migrations": await web.metric(url, "narwhal_migrations_total"),
        "migrations_lost": await web.metric(url, 'narwhal_migrated_streams_total{result="lost"}'),
        "gap_p50_s": web.quantile(gap, 0.5),
        "gap_p99_s": web.quantile(gap, 0.99),
    }


def judge(
    records: list[tuple[float, float, str, int, int]],
    arrivals: list[float],
    t_fault: float,
    t_end: float,
    scenario: Scenario,
) -> dict[str, Any]:
    failed = [r for r in records if r[2] not in ("ok", "hung")]
    reasons: dict[str, int] = {}
    for r in failed:
        reasons[r[2]] = reasons.get(r[2], 0) + 1
    during = [a for a in arrivals if t_fault <= a < t_end]
    out = None
    if not [a for a in during if a >= t_end - QUIET_S]:
        out = (during[-1] - t_fault) if during else 0.0
    back = next((a - t_end for a in arrivals if a >= t_end), None)
    nth = during[EJECT_AFTER - 1] - t_fault if len(during) >= EJECT_AFTER else None
    budget = None
    if nth is not None:
        budget = nth + DEADLINES[scenario.detect] + MONITOR_INTERVAL_S
    return {
        "requests": len(records),
        "ok": sum(1 for r in records if r[2] == "ok"),
        "failed": len(failed),
        "failed_by": reasons,
        # the response's body had begun reaching the client: no retry is allowed there
        "failed_midstream": sum(1 for r in failed if r[4]),
        "failed_during_fault": sum(1 for r in failed if t_fault <= r[1] < t_end + 1.0),
        "hung": sum(1 for r in records if r[2] == "hung"),
        "at_engine_during_fault": len(during),
        "out_of_rotation_s": out,
        "budget_s": budget,
        "back_s": back,
        "arrivals_s": [round(a - t_fault, 3) for a in arrivals if a >= t_fault - 0.5][:400],
    }
