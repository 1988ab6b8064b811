"""Control-plane cost: one monitor pass's CPU time and the handoff write, for 16-256 engines.

The engines are ids behind the tap: each id gets its own loopback port on the tap, which relays
to one of four sims (two prefill, two decode), so every health check, model and metrics read is
answered by a real sim. The router carries no client traffic: its CPU time over the window,
divided by the passes the monitor ran in it, is the CPU cost of one pass.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import Any

from bench import web
from bench.context import Context
from bench.routers import Engines, Running
from bench.sims import SimFlags, SimFleet
from bench.suites.common import start_routers
from bench.tap_client import Tap


async def _monitor(router: Running) -> dict[str, Any]:
    status, body = await web.call("GET", router.url + "/admin/monitor")
    if status != 200:
        raise RuntimeError(f"/admin/monitor: HTTP {status}")
    doc: dict[str, Any] = body
    return doc


async def _handoff(router: Running) -> tuple[float, float]:
    url = router.url + "/metrics"
    total = await web.metric(url, "narwhal_handoff_write_seconds_sum")
    count = await web.metric(url, "narwhal_handoff_write_seconds_count")
    return total, count


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


async def _one(ctx: Context, n: int, fleet: SimFleet) -> dict[str, Any]:
    tap = Tap(ctx.logs / f"tap-control-{n}.log")
    prefill_sims, decode_sims = fleet.role("prefill"), fleet.role("decode")
    for i in range(n // 2):
        tap.add(f"p{i}", prefill_sims[i % 2].port)
    for i in range(n - n // 2):
        tap.add(f"d{i}", decode_sims[i % 2].port)
    await tap.start()
    prefill = [tap.url(f"p{i}") for i in range(n // 2)]
    decode = [tap.url(f"d{i}") for i in range(n - n // 2)]
    try:
        routers = await start_routers(ctx, ["narwhal"], Engines(ctx.model, prefill, decode))
        router = routers["narwhal"]
        assert router.proc is not None
        try:
            await asyncio.sleep(
                min(1.5, ctx.mode.control_s / 2)
            )  # let the first passes (model and generation reads) run
            m0, h0, u0 = await _monitor(router), await _handoff(router), router.proc.usage()
            await asyncio.sleep(ctx.mode.control_s)
            m1, h1, u1 = await _monitor(router), await _handoff(router), router.proc.usage()
        finally:
            await router.stop()
    finally:
        await tap.stop()
    passes = max(1, m1["passes"] - m0["passes"])
    stages: dict[str, list[float]] = {}
    for p in m1["last_passes"]:
        for s in p["stages"]:
            stages.setdefault(s["stage"], []).append(s["duration_s"])
    stage_ms = {k: statistics.fmean(v) * 1000 for k, v in stages.items()}
    writes = max(1.0, h1[1] - h0[1])
    return {
        "engines": n,
        "passes": passes,
        "window_s": ctx.mode.control_s,
        "cpu_ms_per_pass": (u1.cpu_s - u0.cpu_s) * 1000 / passes,
        "pass_wall_ms": sum(stage_ms.values()),
        "stage_ms": stage_ms,
        "handoff_write_ms": (h1[0] - h0[0]) * 1000 / writes,
        "handoff_bytes": _size(ctx.work / "state" / "narwhal" / "handoff.json"),
        "stage_errors": sum(1 for p in m1["last_passes"] if not p["ok"]),
        "rss_kb": u1.rss_kb,
    }


async def run(ctx: Context) -> dict[str, Any]:
    fleet = SimFleet.plan(2, 2, ctx.model, SimFlags(), ctx.logs)
    await fleet.start()
    rows = []
    try:
        for n in ctx.mode.control_sizes:
            row = await _one(ctx, n, fleet)
            rows.append(row)
            ctx.log(
                f"control {n:4} engines: {row['cpu_ms_per_pass']:.1f} ms CPU per pass, "
                f"pass {row['pass_wall_ms']:.1f} ms wall, handoff {row['handoff_write_ms']:.2f} ms"
            )
    finally:
        await fleet.stop()
    return {"rows": rows, "sims": "2 prefill + 2 decode, each id on its own tap port"}
