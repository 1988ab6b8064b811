"""The HTTP stack A/B, router-bound: the floor three ways (aiohttp on asyncio, aiohttp on
uvloop, asyncio protocols + httptools on uvloop), Narwhal on asyncio and on uvloop, and peers.

One prefill and one decode sim that answer at once (no inter-token latency, no TTFT delay),
`max_tokens` 8, c=64 (full mode), non-streaming then streaming; `reps` rounds, each running
every target once in a rotated order, medians over the rounds. Narwhal runs as one process
(`serving.workers: 1`), like the floors. Router CPU is utime + stime of
every process of the target (the one started and its descendants), over the measured run only
(each run is preceded by its own warm-up run, outside the CPU window). Issue 17 §3 asks two
questions of it: does a lower-level stack cut the floor's CPU per request by at least 1.5x, and
does uvloop make Narwhal cheaper once the router, not the engines, is the bottleneck.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.context import PEER_KINDS, Context, router_spec
from bench.procs import reset_peak, tree, tree_usage, usage
from bench.routers import Engines, Running
from bench.sims import SimFlags, SimFleet
from bench.stats import median
from bench.suites.common import run_spec, start_routers

FLAGS = SimFlags(itl_ms=0.0, ttft_per_token_ms=0.0)
MAX_TOKENS = 8
PROMPT_WORDS = 32
METRICS = (
    "throughput",
    "p50_ms",
    "p99_ms",
    "router_cpu_s_per_1k",
    "engine_cpu_s_per_1k",
    "peak_rss_kb",
    "client_cpu_util",
    "processes",
    "failed",
)
STACKS = {
    "direct": "no router",
    "floor": "aiohttp",
    "floor-uvloop": "aiohttp",
    "floor-raw": "protocols + httptools",
    "floor-granian": "granian (Rust) + aiohttp client",
    "narwhal": "aiohttp",
    "narwhal-uvloop": "aiohttp",
    "vllm-router": "Rust (tokio)",
    "sglang-router": "Rust (tokio)",
}


def loop_of(pid: int) -> str:
    """The event loop library mapped into a Python process tree: uvloop, asyncio or -."""
    maps = ""
    for p in tree(pid):
        try:
            maps += Path(f"/proc/{p}/maps").read_text()
        except OSError:
            continue
    if "uvloop/loop." in maps:
        return "uvloop"
    return "asyncio" if "libpython" in maps or "/python3" in maps else "-"


async def _measure(
    ctx: Context,
    router: Running,
    fleet: SimFleet,
    engines: Engines,
    name: str,
    stream: str,
    rep: int,
) -> dict[str, Any]:
    spec = run_spec(
        f"floor_ab-{name}-{stream}-r{rep}",
        router,
        engines,
        ctx.model,
        concurrency=ctx.mode.floor_ab_c,
        max_requests=1_000_000,
        duration_s=ctx.mode.floor_ab_s,
        stream=stream,
        max_tokens=MAX_TOKENS,
        prompt_words=PROMPT_WORDS,
    )
    warm = replace(
        spec, name=spec.name + "-warm", max_requests=4 * ctx.mode.floor_ab_c, duration_s=10.0
    )
    await ctx.loadgen.run(warm)
    sims = [s.proc.pid for s in fleet.sims if s.proc is not None]
    pid = router.proc.pid if router.proc is not None else None
    if pid is not None:
        for p in tree(pid):
            reset_peak(p)
        cpu0, _, _ = tree_usage(pid)
    sims0 = sum(usage(p).cpu_s for p in sims)
    result = await ctx.loadgen.run(spec)
    sims_cpu = sum(usage(p).cpu_s for p in sims) - sims0
    done = result.ok + result.failures
    row: dict[str, Any] = {
        "target": name,
        "stream": stream,
        "rep": rep,
        "ok": result.ok,
        "failed": result.failures,
        "failed_by": result.failed,
        "throughput": result.throughput,
        "p50_ms": result.latency_ms.get("p50", math.nan),
        "p99_ms": result.latency_ms.get("p99", math.nan),
        "client_cpu_util": result.client_cpu_s / result.elapsed_s,
        "engine_cpu_s_per_1k": sims_cpu / done * 1000 if done else math.nan,
        "router_cpu_s_per_1k": math.nan,
        "peak_rss_kb": math.nan,
        "processes": math.nan,
    }
    if pid is not None:
        cpu1, hwm, n = tree_usage(pid)
        row["router_cpu_s"] = cpu1 - cpu0
        row["router_cpu_s_per_1k"] = (cpu1 - cpu0) / done * 1000 if done else math.nan
        row["peak_rss_kb"], row["processes"] = hwm, n
    return row


async def run(ctx: Context) -> dict[str, Any]:
    mode = ctx.mode
    names = []
    for name in mode.floor_ab_targets:
        spec = router_spec(name)
        needs = ["uvloop"] if spec.uvloop else []
        needs += ["uvloop", "httptools"] if spec.kind == "floor-raw" else []
        needs += ["granian"] if spec.kind == "floor-granian" else []
        missing = [n for n in needs if not ctx.venv.has(n)]
        if missing:
            ctx.skipped[name] = f"bench venv lacks {', '.join(missing)}"
            ctx.log(f"floor_ab: {name} skipped: {ctx.skipped[name]}")
            continue
        names.append(name)
    fleet = SimFleet.plan(1, 1, ctx.model, FLAGS, ctx.logs)
    await fleet.start()
    engines = Engines(
        ctx.model, [s.url for s in fleet.role("prefill")], [s.url for s in fleet.role("decode")]
    )
    samples: list[dict[str, Any]] = []
    loops: dict[str, str] = {}
    t0 = time.monotonic()
    routers: dict[str, Running] = {}
    try:
        # One Narwhal process: workers are exec'd on their own, so `bench.uvrun` would put
        # only the control process on uvloop; the stacks compare in one process each.
        routers = await start_routers(ctx, names, engines, tweak={"serving": {"workers": 1}})
        for name, r in routers.items():
            python = r.proc is not None and r.spec.kind not in PEER_KINDS  # peers: Rust, tokio
            loops[name] = loop_of(r.proc.pid) if python and r.proc else "-"
        order0 = list(routers)
        for stream in ("no", "yes"):
            for rep in range(mode.floor_ab_reps):
                order = order0[rep % len(order0) :] + order0[: rep % len(order0)]
                for name in order:
                    row = await _measure(ctx, routers[name], fleet, engines, name, stream, rep)
                    samples.append(row)
                    ctx.log(
                        f"floor_ab {name:14} stream={stream:3} rep={rep} "
                        f"{row['throughput']:7.0f} req/s p50 {row['p50_ms']:.2f} ms "
                        f"cpu/1k {row['router_cpu_s_per_1k']:.3f} s failed {row['failed']}"
                    )
    finally:
        for r in routers.values():
            await r.stop()
        await fleet.stop()
        await ctx.loadgen.reset()
    return {
        "targets": list(routers),
        "loops": loops,
        "stacks": {n: STACKS.get(n, "-") for n in routers},
        "concurrency": mode.floor_ab_c,
        "max_tokens": MAX_TOKENS,
        "prompt_words": PROMPT_WORDS,
        "run_s": mode.floor_ab_s,
        "reps": mode.floor_ab_reps,
        "wall_s": time.monotonic() - t0,
        "medians": medians(samples, list(routers)),
        "samples": samples,
    }


def medians(samples: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    out = []
    for stream in ("no", "yes"):
        for target in targets:
            rows = [s for s in samples if s["target"] == target and s["stream"] == stream]
            if rows:
                point = {m: median(float(r[m]) for r in rows) for m in METRICS}
                out.append({"target": target, "stream": stream, "reps": len(rows), **point})
    return out
