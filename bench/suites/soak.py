"""The chaos soak: Narwhal's active/standby pair, then each peer, under the same load and the
same seeded fault schedule (peers without the router-only faults). See bench.soak.runner.

Two prefill and two decode sims behind the tap (`bench.tap`), which timestamps every leg each
engine receives; the load is a closed loop of 8 clients, half streaming, plus one malformed or
over-long request every 0.5 s.
"""

from __future__ import annotations

from typing import Any

from bench.context import REQUEST_TIMEOUT_S, Context
from bench.sims import SimFlags
from bench.soak import runner
from bench.suites.common import start_routers, tapped_fleet
from bench.suites.faults import restore

FLAGS = SimFlags(itl_ms=5.0, ttft_per_token_ms=0.05)
POLICY = "bounded"  # Narwhal's retrying policy: what an operator runs for goodput


async def run(ctx: Context) -> dict[str, Any]:
    mode = ctx.mode
    async with tapped_fleet(ctx.model, FLAGS, ctx.logs) as (fleet, tap, engines):
        setup = runner.Setup(
            ctx.loadgen, fleet, tap, engines, ctx.work, ctx.model, REQUEST_TIMEOUT_S
        )
        out: dict[str, Any] = {
            "seed": mode.soak_seed,
            "duration_s": mode.soak_s,
            "concurrency": setup.concurrency,
            "max_tokens": setup.max_tokens,
            "itl_ms": FLAGS.itl_ms,
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "client_margin_s": runner.CLIENT_MARGIN_S,
            "placement_tolerance_s": runner.PLACEMENT_TOLERANCE_S,
            "fd_tolerance": runner.FD_TOLERANCE,
            "rss_tolerance_kb": runner.RSS_TOLERANCE_KB,
            "warm_s": runner.WARM_S,
            "peers": {},
        }
        ctx.log(f"soak narwhal: {mode.soak_s:.0f} s, seed {mode.soak_seed}")
        out["narwhal"] = await runner.run_narwhal(setup, mode.soak_s, mode.soak_seed, POLICY)
        ctx.log(f"soak narwhal: {out['narwhal']['invariants']}")
        await restore(fleet)
        for name in mode.soak_routers:
            if name == "narwhal" or not ctx.available(name):
                continue
            routers = await start_routers(ctx, [name], engines)
            if name not in routers:
                continue
            await ctx.loadgen.reset()
            try:
                ctx.log(f"soak {name}: {mode.soak_s:.0f} s, seed {mode.soak_seed}")
                out["peers"][name] = await runner.run_peer(
                    setup, routers[name].url, name, mode.soak_s, mode.soak_seed
                )
            finally:
                await routers[name].stop()
                await restore(fleet)
    return out
