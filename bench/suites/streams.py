"""Many streams: `mode.streams` concurrent slow SSE streams through each router.

One prefill and two decode sims (ITL 100 ms: at 50 ms, 1,000 streams are 20,000 events per
second, more than two cores running the sims, the router and the client can carry; even the
direct baseline stalled). Each of the load generator's `streams` workers opens a stream,
reads it to `[DONE]` and opens the next one until the run ends, so about `streams` streams are
open at once. Measured: data events delivered per second in the steady window, the gaps between
consecutive events of a stream (a gap over 10 ITL is a stall), and the router's CPU and peak
memory above its idle RSS, per stream.
"""

from __future__ import annotations

import asyncio
import signal
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import web
from bench.context import REQUEST_TIMEOUT_S, Context, router_spec
from bench.routers import Engines, Running, start_router
from bench.sims import SimFlags, SimFleet
from bench.suites.common import measure, run_spec, start_routers

ITL_MS = 100.0
FLAGS = SimFlags(itl_ms=ITL_MS, ttft_per_token_ms=0.05, max_concurrency=8192)
NARWHAL = {"serving": {"max_connections": 4096, "queue_limit": 4096}}


def _spec(ctx: Context, name: str, router: Running, engines: Engines, run_s: float) -> Any:
    mode = ctx.mode
    return run_spec(
        name,
        router,
        engines,
        ctx.model,
        concurrency=mode.streams,
        max_requests=1_000_000,
        duration_s=mode.streams_ramp_s + run_s,
        ramp_s=mode.streams_ramp_s,
        stream="yes",
        max_tokens=mode.streams_tokens,
        prompt_words=32,
        stall_ms=10 * ITL_MS,
    )


async def _snapshot(router: Running, where: Path, n: int) -> tracemalloc.Snapshot:
    assert router.proc is not None
    path = where / f"snap-{n}.bin"
    router.proc.signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60  # a snapshot of a busy process takes seconds
    while time.monotonic() < deadline:
        if path.exists():
            return await asyncio.to_thread(tracemalloc.Snapshot.load, str(path))
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no tracemalloc snapshot at {path} after 60 s")


def _module(filename: str) -> str:
    """`aiohttp/client_reqrep.py`, `asyncio/events.py`, `narwhal/dataplane/proxy.py`..."""
    parts = Path(filename).parts
    for root in ("narwhal", "aiohttp", "asyncio", "multidict", "yarl", "prometheus_client"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1 :])
    return Path(filename).name


async def _attribute(ctx: Context, engines: Engines) -> dict[str, Any]:
    """Where an open stream's memory goes: Narwhal under tracemalloc (bench.traced), one
    snapshot when idle and one with the streams open, the difference grouped by module."""
    where = ctx.work / "snapshots"
    # One process: tracemalloc sees the process it is signalled in, and a worker's streams
    # hold the same objects as the single process's.
    one = {"serving": {**NARWHAL["serving"], "workers": 1}}
    spec = replace(router_spec("narwhal"), narwhal=one, snapshots=where)
    router = await start_router(spec, engines, ctx.work, ctx.venv, REQUEST_TIMEOUT_S)
    try:
        idle = await _snapshot(router, where, 0)
        hold_s = 4.0
        load = asyncio.create_task(
            ctx.loadgen.run(_spec(ctx, "streams-traced", router, engines, hold_s))
        )
        await asyncio.sleep(ctx.mode.streams_ramp_s + hold_s / 2)
        open_streams = await web.metric(router.url + "/metrics", "narwhal_engine_in_flight")
        busy = await _snapshot(router, where, 1)
        await load
    finally:
        await router.stop()
        await ctx.loadgen.reset()
    by_module: dict[str, int] = {}
    for stat in busy.compare_to(idle, "filename"):
        name = _module(stat.traceback[0].filename)
        by_module[name] = by_module.get(name, 0) + stat.size_diff
    streams = max(1.0, open_streams)
    total = sum(by_module.values())
    top = sorted(by_module.items(), key=lambda kv: -kv[1])[:12]
    return {
        "open_streams": open_streams,
        "traced_kb_per_stream": total / streams / 1024,
        "modules": [{"module": m, "kb_per_stream": b / streams / 1024} for m, b in top],
    }


async def run(ctx: Context) -> dict[str, Any]:
    mode = ctx.mode
    fleet = SimFleet.plan(1, 2, ctx.model, FLAGS, ctx.logs)
    await fleet.start()
    engines = Engines(
        ctx.model, [s.url for s in fleet.role("prefill")], [s.url for s in fleet.role("decode")]
    )
    rows: list[dict[str, Any]] = []
    try:
        for name in mode.streams_targets:
            routers = await start_routers(ctx, [name], engines, tweak=NARWHAL)
            if name not in routers:
                continue
            router = routers[name]
            try:
                spec = _spec(ctx, f"streams-{name}", router, engines, mode.streams_run_s)
                m = await measure(ctx, router, spec)
            finally:
                await router.stop()
                await ctx.loadgen.reset()
            row = {"target": name, **m.row()}
            extra_kb = max(0, m.peak_kb - m.rss_before_kb)
            row["memory_per_stream_kb"] = extra_kb / mode.streams if m.peak_kb else None
            started = m.result.ok + m.result.failures + m.result.hung
            row["cpu_ms_per_stream"] = m.router_cpu_s * 1000 / started if started else None
            chunks = max(1, m.result.chunks)
            row["cpu_us_per_chunk"] = m.router_cpu_s * 1e6 / chunks
            rows.append(row)
            ctx.log(
                f"streams {name:14} {row['steady_chunks_per_s']:8.0f} chunks/s "
                f"peak in flight {row['peak_in_flight']} stalls {row['stalls']} "
                f"failed {row['failed']} hung {row['hung']}"
            )
        attribution = await _attribute(ctx, engines) if "narwhal" in mode.streams_targets else None
    finally:
        await fleet.stop()
    return {
        "attribution": attribution,
        "streams": mode.streams,
        "itl_ms": ITL_MS,
        "tokens": mode.streams_tokens,
        "run_s": mode.streams_run_s,
        "ramp_s": mode.streams_ramp_s,
        "stall_ms": 10 * ITL_MS,
        "narwhal_config": NARWHAL,
        "rows": rows,
    }
