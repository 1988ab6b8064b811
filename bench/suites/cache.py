"""Cache-aware placement against the peers (DESIGN §11): where each request's prefill runs.

Four prefill and two decode sims that model a prefix cache (vLLM's block size 16, LRU at a
fixed capacity, a running queue of `max_num_seqs`, prefill time per uncached token, the
running requests' prompts computed one at a time as a GPU shares its compute) and
publish vLLM's KV events over ZMQ, all tokenizing with the bench's word-level tokenizer (the
one Narwhal loads). The same fleet serves every arm; each arm starts on empty caches
(`POST /reset_prefix_cache`). Arms: Narwhal `least_loaded`, Narwhal `prefix` with events and
without (its approximate index of what it routed), sglang-router and vllm-router with
`--policy cache_aware`, and the oracle (bench.oracle: asks every engine its true cache before
each prefill). Then Narwhal `prefix` again with one worker (the sharing across workers), and
on a second fleet that drops 1% of its event messages (replay on).

Each workload (bench.loadgen.workloads) runs as a ramp of closed-loop steps (`cache_steps`
clients), every step `cache_step_s` seconds of streamed completions. Measured per arm and
step: the prefill engines' token hit rate (their own `vllm:prefix_cache_hits_total` over
`queries`), TTFT p50/p90/p99, the gap between tokens, output tokens/s, goodput (requests per
second whose first token came within `TTFT_SLO_MS`), and the router's CPU per request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from bench import web
from bench.context import REQUEST_TIMEOUT_S, Context
from bench.loadgen.workloads import Workload
from bench.placement_bench import measure_ingestion
from bench.routers import Engines, RouterSpec, Running, start_router
from bench.sims import SimFlags, SimFleet
from bench.suites.common import measure, run_spec

BLOCK = 16
KV_BLOCKS = 640  # per prefill engine: 10 KiB tokens, about 9 system prompts beside the running
MAX_NUM_SEQS = 4
# serial: an engine computes 2,000 prompt tokens/s, whatever runs (an 800-token prompt alone:
# 0.4 s uncached, 16 ms with 768 cached)
TTFT_PER_TOKEN_MS = 0.5
ITL_MS = 20.0
MAX_TOKENS = 8
TTFT_SLO_MS = 1000.0
DROP_FRACTION = 0.01

WORKLOADS = {
    # 32 system prompts of 768 tokens (1,536 blocks): more than one engine holds, less than 4
    "shared_prefix": Workload("shared_prefix", groups=32, system_words=768, question_words=32),
    # conversations of 4 turns from 512 to 800 tokens
    "multi_turn": Workload(
        "multi_turn", system_words=512, question_words=32, turns=4, answer_words=64
    ),
    "no_sharing": Workload("no_sharing", system_words=768, question_words=32),
}


@dataclass(frozen=True, slots=True)
class Arm:
    spec: RouterSpec
    fleet: str = "main"  # "drops": the fleet that drops DROP_FRACTION of its event messages
    workloads: tuple[str, ...] = tuple(WORKLOADS)


def _narwhal(name: str, policy: str, tokenizer: str, model: str, **kw: Any) -> RouterSpec:
    placement: dict[str, Any] = {"policy": policy, "block_size_tokens": BLOCK}
    if policy == "prefix":
        placement["tokenizers"] = {model: tokenizer}
    workers = kw.pop("workers", "auto")
    return RouterSpec(name, "narwhal", workers=workers, narwhal={"placement": placement}, **kw)


def arms(model: str) -> list[Arm]:
    """Every arm, in the order they run; `model` is the bench tokenizer's directory (the
    served model's name, and the tokenizer Narwhal loads for it)."""
    sharing = ("shared_prefix", "multi_turn")
    return [
        Arm(_narwhal("narwhal-least-loaded", "least_loaded", model, model)),
        Arm(_narwhal("narwhal-prefix", "prefix", model, model, kv_events=True)),
        Arm(_narwhal("narwhal-prefix-no-events", "prefix", model, model)),
        Arm(RouterSpec("sglang-router", "sglang-router", peer_policy="cache_aware")),
        Arm(RouterSpec("vllm-router", "vllm-router", peer_policy="cache_aware")),
        Arm(RouterSpec("oracle", "oracle")),
        Arm(
            _narwhal("narwhal-prefix-w1", "prefix", model, model, kv_events=True, workers=1),
            workloads=sharing,
        ),
        Arm(
            _narwhal("narwhal-prefix-drops", "prefix", model, model, kv_events=True),
            fleet="drops",
            workloads=sharing,
        ),
    ]


def flags(tokenizer: str, drop_fraction: float = 0.0) -> SimFlags:
    """Every sim tokenizes with `tokenizer`; the prefill sims cache and publish."""
    cache = ("--block-size", str(BLOCK), "--kv-blocks", str(KV_BLOCKS))
    events = ("--kv-events-port", "0", "--kv-events-replay-port", "0")
    drops = ("--kv-events-drop-fraction", str(drop_fraction)) if drop_fraction else ()
    words = ("--tokenizer", tokenizer)
    queue = ("--max-num-seqs", str(MAX_NUM_SEQS), "--serial-prefill")
    return SimFlags(
        itl_ms=ITL_MS,
        ttft_per_token_ms=TTFT_PER_TOKEN_MS,
        max_concurrency=4096,
        prefill_extra=(*cache, *queue, *events, *drops, *words),
        decode_extra=words,
    )


async def _fleet(ctx: Context, drop_fraction: float) -> tuple[SimFleet, Engines]:
    fleet = SimFleet.plan(4, 2, ctx.model, flags(ctx.model, drop_fraction), ctx.logs)
    await fleet.start()
    events: dict[str, dict[str, str]] = {}
    for sim in fleet.role("prefill"):
        status, info = await web.call("GET", sim.url + "/sim/kv_events")
        if status != 200:
            raise RuntimeError(f"{sim.name}: no KV events ({status} {info})")
        events[sim.url] = {k: info[k] for k in ("endpoint", "replay_endpoint", "topic")}
    prefill = [s.url for s in fleet.role("prefill")]
    decode = [s.url for s in fleet.role("decode")]
    return fleet, Engines(ctx.model, prefill, decode, events)


async def _cache_counters(engines: Engines) -> tuple[float, float]:
    """(queried, hit) prompt tokens, summed over the prefill engines' own counters."""
    queried = hit = 0.0
    for url in engines.prefill:
        queried += await web.metric(url + "/metrics", "vllm:prefix_cache_queries_total")
        hit += await web.metric(url + "/metrics", "vllm:prefix_cache_hits_total")
    return queried, hit


def _indexes(router: Running) -> bool:
    """Narwhal placing by prefix: it keeps an index (and exports its size)."""
    placement = (router.spec.narwhal or {}).get("placement") or {}
    return router.spec.kind == "narwhal" and placement.get("policy") == "prefix"


async def _ingested(router: Running) -> float:
    """Blocks stored and removed by the engines' events, as the control process applied them."""
    return await web.metric(router.url + "/metrics", "narwhal_kv_event_blocks_total")


async def _reset(engines: Engines) -> None:
    for url in engines.prefill:
        status, body = await web.call("POST", url + "/reset_prefix_cache")
        if status != 200:
            raise RuntimeError(f"{url}: reset_prefix_cache {status} {body}")


async def _run_arm(ctx: Context, arm: Arm, engines: Engines, workload: str) -> list[dict[str, Any]]:
    await _reset(engines)
    router = await start_router(arm.spec, engines, ctx.work, ctx.venv, REQUEST_TIMEOUT_S)
    if router.config is not None:
        ctx.configs.setdefault(arm.spec.name, router.config)
    ctx.commands.setdefault(arm.spec.name, " ".join(router.argv))
    rows: list[dict[str, Any]] = []
    try:
        for step, clients in enumerate(ctx.mode.cache_steps):
            rows.append(await _step(ctx, router, engines, workload, step, clients))
    finally:
        await router.stop()
        await ctx.loadgen.reset()
    return rows


async def _step(
    ctx: Context, router: Running, engines: Engines, workload: str, step: int, clients: int
) -> dict[str, Any]:
    name = router.spec.name
    shape = replace(WORKLOADS[workload], round=step)
    spec = run_spec(
        f"cache-{workload}-{name}-c{clients}",
        router,
        engines,
        ctx.model,
        concurrency=clients,
        max_requests=1_000_000,
        duration_s=ctx.mode.cache_step_s,
        stream="yes",
        max_tokens=MAX_TOKENS,
        workload=shape.to_json(),
        ttft_slo_ms=TTFT_SLO_MS,
    )
    index = _indexes(router)
    queried0, hit0 = await _cache_counters(engines)
    ingested0 = await _ingested(router) if index else 0.0
    m = await measure(ctx, router, spec)
    queried1, hit1 = await _cache_counters(engines)
    r = m.result
    done = r.ok + r.failures + r.hung
    queried = queried1 - queried0
    row = {
        "arm": name,
        "workload": workload,
        "clients": clients,
        "ok": r.ok,
        "failed": r.failures,
        "failed_by": r.failed,
        "hung": r.hung,
        "hit_rate": (hit1 - hit0) / queried if queried else None,
        "ttft_ms": r.ttft_ms,
        "gap_ms": r.gap_ms,
        "output_tokens_per_s": r.chunks / r.elapsed_s,
        "goodput_per_s": r.good / r.elapsed_s,
        "throughput": r.throughput,
        "router_cpu_ms_per_request": m.router_cpu_s * 1000 / done if done else None,
    }
    if index:  # Narwhal by prefix: its index's size and the events it took in, per process
        metrics = router.url + "/metrics"
        row["index_blocks"] = await web.metric(metrics, "narwhal_prefix_index_blocks")
        row["index_bytes"] = await web.metric(metrics, "narwhal_prefix_index_bytes")
        row["ingested_blocks_per_s"] = (await _ingested(router) - ingested0) / r.elapsed_s
    hit = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.0%}"
    p90 = (r.ttft_ms or {}).get("p90", float("nan"))
    ctx.log(
        f"cache {workload:13} {name:24} c={clients:<3} hit {hit:>4} TTFT p90 {p90:7.0f} ms "
        f"{row['output_tokens_per_s']:6.0f} tok/s failed {r.failures} hung {r.hung}"
    )
    return row


async def run(ctx: Context) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    plan = arms(ctx.model)
    for fleet_name, drop in (("main", 0.0), ("drops", DROP_FRACTION)):
        mine = [a for a in plan if a.fleet == fleet_name and a.spec.kind not in ctx.skipped]
        if not mine:
            continue
        fleet, engines = await _fleet(ctx, drop)
        try:
            for workload in ctx.mode.cache_workloads:
                for arm in mine:
                    if workload in arm.workloads:
                        rows += await _run_arm(ctx, arm, engines, workload)
        finally:
            await fleet.stop()
    for arm in plan:
        if arm.spec.kind in ctx.skipped:
            ctx.notes.append(f"cache: {arm.spec.name} not run ({ctx.skipped[arm.spec.kind]})")
    return {
        "rows": rows,
        "steps": list(ctx.mode.cache_steps),
        "step_s": ctx.mode.cache_step_s,
        "workloads": {k: WORKLOADS[k].to_json() for k in ctx.mode.cache_workloads},
        "fleet": {
            "prefill": 4,
            "decode": 2,
            "block_size": BLOCK,
            "kv_blocks": KV_BLOCKS,
            "max_num_seqs": MAX_NUM_SEQS,
            "serial_prefill": True,
            "ttft_per_token_ms": TTFT_PER_TOKEN_MS,
            "itl_ms": ITL_MS,
            "max_tokens": MAX_TOKENS,
            "drop_fraction": DROP_FRACTION,
        },
        "ttft_slo_ms": TTFT_SLO_MS,
        # What one core of this machine decodes and applies, measured in this run.
        "ingestion_capacity": dict(zip(("stored", "removed"), measure_ingestion(), strict=True)),
    }
