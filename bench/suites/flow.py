"""Flow control under overload (DESIGN §13, issue 31 §6): the sim fleet offered twice what it
can serve, three priorities, four client keys, one of them sending 10x the others.

One prefill and one decode `narwhal-sim`, each refusing (429) beyond `--max-concurrency`
`CONCURRENCY`, so the fleet's capacity is known: a request holds a decode slot for
`MAX_TOKENS` x `ITL_MS`, so `CONCURRENCY` / that many requests per second. Arrivals are open
loop (bench.loadgen.flow: a seeded Poisson process per key and priority, the same for every
arm), streamed, the body's `priority` set, the key sent as `Authorization: Bearer`, and a
429 never retried. Each arm first runs unloaded (a tenth of the capacity, priority 0) for its
unloaded TTFT, then `flow_s` seconds at twice the capacity.

Arms: Narwhal with flow control (`serving.policy: bounded`, `engines[].max_concurrency`, the
four keys in `auth`, each with an equal-weight `auth.key_policies` entry, `flow.max_wait_s`
the mode's `flow_max_wait_s`); the same with `flow.headroom_slots`, and with
`flow.preempt_priority`; Narwhal with it off (`single_attempt`, the same config
otherwise: today's answer to a full fleet); vllm-router and sglang-router with their own
concurrency limit and FIFO queue (`--max-concurrent-requests`, `--queue-size`,
`--queue-timeout-secs`: the same bounds), which have no priorities or per-key shares. The
records go to the report (bench.report.flow), which computes and judges everything.
"""

from __future__ import annotations

import hashlib
from typing import Any

from bench import web
from bench.context import CLIENT_GRACE_S, REQUEST_TIMEOUT_S, Context
from bench.loadgen.flow import FlowClass, FlowSpec
from bench.routers import Engines, RouterSpec, start_router
from bench.sims import SimFlags, SimFleet

CONCURRENCY = 8  # per engine: the sims' --max-concurrency, Narwhal's engines[].max_concurrency
ITL_MS = 20.0
TTFT_PER_TOKEN_MS = 1.0
MAX_TOKENS = 16
MAX_TOKENS_SPREAD = 8  # each answer 8-24 tokens, 16 on average (see FlowSpec)
PROMPT_WORDS = 32
OVERLOAD = 2.0  # offered load over capacity
UNLOADED = 0.1  # the unloaded run's load over capacity
QUEUE_LIMIT = 1024  # Narwhal's flow.queue_limit, the peers' --queue-size
SLO_FACTOR = 4.0  # priority 0's TTFT SLO: this times the unloaded TTFT p50
# `flow.headroom_slots` of the headroom arm: one slot of each role kept for priority 0, so
# that an urgent arrival at a full fleet usually finds one (no preemption), at the cost of the
# slot left idle while none comes. The judged arm runs the default (none).
HEADROOM_SLOTS = 1
# `flow.preempt_priority` of the preemption arm: priority 0 takes a slot from a running stream
# of priority 1 or 2, which goes on later from its last token.
PREEMPT_PRIORITY = 0
# Loopback only, not secrets. Key 0 is the heavy one.
KEYS = tuple(f"sk-narwhal-flow-{name}-0123456789abcdef" for name in ("heavy", "k1", "k2", "k3"))
# Offered load per (key, priority), as a share of the fleet's capacity; 2.0 in all. Every key
# sends the same at priorities 0 and 1; at priority 2 (batch) the heavy key sends 10x each of
# the others. The counters that share service out (DESIGN §13) are per key across
# priorities, so a key sending 10x at every priority would be behind the others at the lowest
# by design, and Jain's index per priority would measure that rather than the share.
TRAFFIC: dict[tuple[int, int], float] = {
    **{(k, 0): 0.075 for k in range(4)},
    **{(k, 1): 0.1 for k in range(4)},
    (0, 2): 1.0,
    **{(k, 2): 0.1 for k in (1, 2, 3)},
}


def capacity_rps() -> float:
    """Requests per second the fleet serves: the decode engine's slots over a request's time
    on one (its tokens at the ITL); the prefill engine, at a few ms per request, is not the
    bound."""
    return CONCURRENCY / (MAX_TOKENS * ITL_MS / 1000)


def key_label(key: str) -> str:
    """The key's label as Narwhal writes it (metrics, `auth.key_policies`)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def arms(max_wait_s: int) -> list[RouterSpec]:
    keys = ",".join(KEYS)  # auth.api_keys_env reads comma-separated keys
    policies = {key_label(k): {"weight": 1} for k in KEYS}
    narwhal = {
        "auth": {"key_policies": policies},
        "flow": {"max_wait_s": max_wait_s, "queue_limit": QUEUE_LIMIT},
    }
    headroom = {**narwhal, "flow": {**narwhal["flow"], "headroom_slots": HEADROOM_SLOTS}}
    preempt = {**narwhal, "flow": {**narwhal["flow"], "preempt_priority": PREEMPT_PRIORITY}}
    queue = (
        "--max-concurrent-requests",
        str(CONCURRENCY),
        "--queue-size",
        str(QUEUE_LIMIT),
        "--queue-timeout-secs",
        str(max_wait_s),
    )
    return [
        RouterSpec(
            "narwhal-flow",
            "narwhal",
            policy="bounded",
            api_key=keys,
            narwhal=narwhal,
            engine_max_concurrency=CONCURRENCY,
        ),
        RouterSpec(
            "narwhal-flow-headroom",
            "narwhal",
            policy="bounded",
            api_key=keys,
            narwhal=headroom,
            engine_max_concurrency=CONCURRENCY,
        ),
        RouterSpec(
            "narwhal-flow-preempt",
            "narwhal",
            policy="bounded",
            api_key=keys,
            narwhal=preempt,
            engine_max_concurrency=CONCURRENCY,
        ),
        RouterSpec(
            "narwhal-flow-off",
            "narwhal",
            api_key=keys,
            narwhal=narwhal,
            engine_max_concurrency=CONCURRENCY,
        ),
        RouterSpec("vllm-router", "vllm-router", peer_args=queue),
        RouterSpec("sglang-router", "sglang-router", peer_args=queue),
    ]


def classes(load: float) -> tuple[FlowClass, ...]:
    """The traffic scaled so that its total is `load` times the capacity."""
    scale = load / sum(TRAFFIC.values()) * capacity_rps()
    return tuple(FlowClass(k, p, share * scale) for (k, p), share in sorted(TRAFFIC.items()))


def _spec(name: str, url: str, model: str, cls: tuple[FlowClass, ...], s: float) -> FlowSpec:
    return FlowSpec(
        name=name,
        url=url + "/v1/completions",
        model=model,
        keys=KEYS,
        classes=cls,
        duration_s=s,
        deadline_s=REQUEST_TIMEOUT_S + CLIENT_GRACE_S,
        max_tokens=MAX_TOKENS,
        max_tokens_spread=MAX_TOKENS_SPREAD,
        prompt_words=PROMPT_WORDS,
    )


async def _narwhal_counts(url: str) -> dict[str, float]:
    """Narwhal's own shed counts by reason, from its metrics."""
    status, text = await web.call("GET", url + "/metrics")
    out: dict[str, float] = {}
    if status != 200:
        return out
    for line in str(text).splitlines():
        if line.startswith("narwhal_shed_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.removeprefix("narwhal_shed_total")] = float(value)
    return out


async def _run_arm(ctx: Context, spec: RouterSpec, engines: Engines) -> dict[str, Any]:
    router = await start_router(spec, engines, ctx.work, ctx.venv, REQUEST_TIMEOUT_S)
    if router.config is not None:
        ctx.configs.setdefault(spec.name, router.config)
    ctx.commands.setdefault(spec.name, " ".join(router.argv))
    try:
        unloaded = await ctx.loadgen.flow(
            _spec(
                f"flow-{spec.name}-unloaded",
                router.url,
                ctx.model,
                (FlowClass(1, 0, UNLOADED * capacity_rps()),),
                ctx.mode.flow_unloaded_s,
            )
        )
        loaded = await ctx.loadgen.flow(
            _spec(f"flow-{spec.name}", router.url, ctx.model, classes(OVERLOAD), ctx.mode.flow_s)
        )
        shed = await _narwhal_counts(router.url) if spec.kind == "narwhal" else {}
    finally:
        await router.stop()
        await ctx.loadgen.reset()
    sent = len(loaded.records)
    ok = sum(1 for r in loaded.records if r[3] == 200 and not r[7])
    refused = sum(1 for r in loaded.records if r[3] == 429)
    ctx.log(
        f"flow {spec.name:17} sent {sent} served {ok} refused {refused} "
        f"other {sent - ok - refused} in {loaded.elapsed_s:.1f} s"
    )
    return {
        "arm": spec.name,
        "unloaded": unloaded.records,
        "records": loaded.records,
        "elapsed_s": loaded.elapsed_s,
        "narwhal_shed": shed,
    }


async def run(ctx: Context) -> dict[str, Any]:
    fleet = SimFleet.plan(
        1,
        1,
        ctx.model,
        SimFlags(itl_ms=ITL_MS, ttft_per_token_ms=TTFT_PER_TOKEN_MS, max_concurrency=CONCURRENCY),
        ctx.logs,
    )
    await fleet.start()
    engines = Engines(
        ctx.model, [s.url for s in fleet.role("prefill")], [s.url for s in fleet.role("decode")]
    )
    results: list[dict[str, Any]] = []
    try:
        for spec in arms(ctx.mode.flow_max_wait_s):
            if spec.kind in ctx.skipped:
                ctx.notes.append(f"flow: {spec.name} not run ({ctx.skipped[spec.kind]})")
                continue
            results.append(await _run_arm(ctx, spec, engines))
    finally:
        await fleet.stop()
    return {
        "arms": results,
        "flow_s": ctx.mode.flow_s,
        "unloaded_s": ctx.mode.flow_unloaded_s,
        "fleet": {
            "prefill": 1,
            "decode": 1,
            "max_concurrency": CONCURRENCY,
            "itl_ms": ITL_MS,
            "ttft_per_token_ms": TTFT_PER_TOKEN_MS,
            "max_tokens": MAX_TOKENS,
            "max_tokens_spread": MAX_TOKENS_SPREAD,
            "prompt_words": PROMPT_WORDS,
            "capacity_rps": capacity_rps(),
        },
        "overload": OVERLOAD,
        "unloaded_load": UNLOADED,
        "max_wait_s": ctx.mode.flow_max_wait_s,
        "queue_limit": QUEUE_LIMIT,
        "headroom_slots": HEADROOM_SLOTS,
        "preempt_priority": PREEMPT_PRIORITY,
        "slo_factor": SLO_FACTOR,
        "heavy_key": 0,
        "traffic": [[k, p, share] for (k, p), share in sorted(TRAFFIC.items())],
        "classes": [[c.key, c.priority, c.rate_per_s] for c in classes(OVERLOAD)],
    }
