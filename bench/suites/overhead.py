"""Overhead: direct PD round trips vs Narwhal vs each peer, same engines, runs alternated.

One prefill and one decode sim; for each stream mode and concurrency, `reps` rounds, each round
running every target once in a rotated order. Reported: medians over the rounds.
"""

from __future__ import annotations

from typing import Any

from bench.context import CLIENT_GRACE_S, REQUEST_TIMEOUT_S, Context
from bench.loadgen.spec import RunSpec
from bench.routers import Engines, Running
from bench.sims import SimFlags, SimFleet
from bench.stats import median
from bench.suites.common import measure, run_spec, start_routers

FLAGS = SimFlags(itl_ms=1.0, ttft_per_token_ms=0.05)
MAX_TOKENS = 16
PROMPT_WORDS = 32
METRICS = (
    "throughput",
    "p50_ms",
    "p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "router_cpu_s_per_1k",
    "peak_rss_kb",
    "client_cpu_util",
    "failed",
)


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    lat, ttft = row["latency_ms"], row["ttft_ms"]
    return {
        **row,
        "p50_ms": lat.get("p50", float("nan")),
        "p99_ms": lat.get("p99", float("nan")),
        "ttft_p50_ms": ttft.get("p50", float("nan")),
        "ttft_p99_ms": ttft.get("p99", float("nan")),
    }


async def run(ctx: Context) -> dict[str, Any]:
    mode = ctx.mode
    fleet = SimFleet.plan(1, 1, ctx.model, FLAGS, ctx.logs)
    await fleet.start()
    engines = Engines(
        ctx.model, [s.url for s in fleet.role("prefill")], [s.url for s in fleet.role("decode")]
    )
    routers = await start_routers(ctx, list(mode.overhead_targets), engines)
    samples: list[dict[str, Any]] = []
    try:
        names = list(routers)
        for stream in ("no", "yes"):
            for c in mode.concurrency:
                for rep in range(mode.reps):
                    order = names[rep % len(names) :] + names[: rep % len(names)]
                    for name in order:
                        spec = run_spec(
                            f"overhead-{name}-c{c}-{stream}-r{rep}",
                            routers[name],
                            engines,
                            ctx.model,
                            concurrency=c,
                            max_requests=200_000,
                            duration_s=mode.run_s * (2 if c == 1 else 1),  # c=1: few samples
                            stream=stream,
                            max_tokens=MAX_TOKENS,
                            prompt_words=PROMPT_WORDS,
                            warmup_requests=max(4, c),
                        )
                        m = await measure(ctx, routers[name], spec)
                        row = _flat(m.row())
                        samples.append(
                            {"target": name, "stream": stream, "c": c, "rep": rep, **row}
                        )
                        ctx.log(
                            f"overhead {name:14} c={c:<3} stream={stream:3} rep={rep} "
                            f"{row['throughput']:7.0f} req/s p50 {row['p50_ms']:.2f} ms "
                            f"failed {row['failed']}"
                        )
        paired = [await _paired(ctx, routers, engines, stream) for stream in ("no", "yes")]
    finally:
        for r in routers.values():
            await r.stop()
        await fleet.stop()
        await ctx.loadgen.reset()
    return {
        "paired": paired,
        "targets": list(routers),
        "sim_flags": {"itl_ms": FLAGS.itl_ms, "ttft_per_token_ms": FLAGS.ttft_per_token_ms},
        "max_tokens": MAX_TOKENS,
        "run_s": mode.run_s,
        "prompt_words": PROMPT_WORDS,
        "medians": medians(samples, list(routers)),
        "samples": samples,
    }


async def _paired(
    ctx: Context, routers: dict[str, Running], engines: Engines, stream: str
) -> dict[str, Any]:
    """c=1, one request per target per round in rotated order: latency added over direct,
    with the machine's slow drift (seen here as ±1 ms between runs) cancelled out."""
    names = ["direct", *(n for n in routers if n != "direct")]
    spec = RunSpec(
        name=f"overhead-paired-{stream}",
        target="direct",
        concurrency=1,
        max_requests=100_000,
        duration_s=ctx.mode.paired_s,
        deadline_s=REQUEST_TIMEOUT_S + CLIENT_GRACE_S,
        model=ctx.model,
        stream=stream,
        prefill=tuple(engines.prefill),
        decode=tuple(engines.decode),
        max_tokens=MAX_TOKENS,
        prompt_words=PROMPT_WORDS,
        warmup_requests=3,
        paired=tuple(
            routers[n].url + "/v1/completions" if n in routers and routers[n].url else ""
            for n in names
        ),
    )
    result = await ctx.loadgen.run(spec)
    rows = [{**row, "target": name} for name, row in zip(names, result.paired, strict=True)]
    for row in rows:
        ctx.log(
            f"paired {row['target']:14} stream={stream:3} p50 {row['latency_ms']['p50']:.2f} ms "
            f"added {row['diff_p50_ms']:+.2f} ms ({row['rounds']} rounds)"
        )
    return {"stream": stream, "duration_s": ctx.mode.paired_s, "rows": rows}


def medians(samples: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(s["stream"], s["c"]) for s in samples})
    for stream, c in keys:
        for target in targets:
            rows = [
                s
                for s in samples
                if s["target"] == target and s["stream"] == stream and s["c"] == c
            ]
            if rows:
                point = {m: median(float(r[m]) for r in rows) for m in METRICS}
                out.append({"target": target, "stream": stream, "c": c, "reps": len(rows), **point})
    return out
