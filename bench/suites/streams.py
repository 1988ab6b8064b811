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

from typing import Any

from bench.context import Context
from bench.routers import Engines
from bench.sims import SimFlags, SimFleet
from bench.suites.common import measure, run_spec, start_routers

ITL_MS = 100.0
FLAGS = SimFlags(itl_ms=ITL_MS, ttft_per_token_ms=0.05, max_concurrency=8192)
NARWHAL = {"serving": {"max_connections": 4096, "queue_limit": 4096}}


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
                spec = run_spec(
                    f"streams-{name}",
                    router,
                    engines,
                    ctx.model,
                    concurrency=mode.streams,
                    max_requests=1_000_000,
                    duration_s=mode.streams_ramp_s + mode.streams_run_s,
                    ramp_s=mode.streams_ramp_s,
                    stream="yes",
                    max_tokens=mode.streams_tokens,
                    prompt_words=32,
                    stall_ms=10 * ITL_MS,
                )
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
    finally:
        await fleet.stop()
    return {
        "streams": mode.streams,
        "itl_ms": ITL_MS,
        "tokens": mode.streams_tokens,
        "run_s": mode.streams_run_s,
        "ramp_s": mode.streams_ramp_s,
        "stall_ms": 10 * ITL_MS,
        "narwhal_config": NARWHAL,
        "rows": rows,
    }
