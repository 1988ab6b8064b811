"""The placement decision: eligible engines of a role ranked by cached prefix against load.

A pure function over a snapshot (each candidate's load and matched prefix) so the request path,
`POST /admin/placement` and the benchmark's oracle all rank the same way. It only orders the
engines that eligibility already allowed (spec: drains, quarantine, last-engine protection are
decided before); it never adds one.

The score of an engine is the share of the prompt it would not recompute, minus its load
relative to the most loaded candidate, each with a weight:

    score = prefix_weight * matched / prompt  -  load_weight * load / (1 + max load)

`load` is Narwhal's own in-flight legs on the engine plus its scraped
`vllm:num_requests_waiting` (when fresh), and `kv_usage` (scraped `vllm:kv_cache_usage_perc`)
counts against a decode engine, which needs room for the blocks it pulls. The imbalance guard,
per engine: a candidate that carries more than `imbalance_abs` legs more than the least
loaded one, and more than `imbalance_rel` times as many, gets no credit for its cache, so a
hot prefix cannot pile every request on one engine: its requests go to a lighter engine,
which then holds the prefix too (a hot prefix ends up on as many engines as its load needs).
The other candidates keep their credit. (sglang-router's cache-aware policy, and ours until
the `cache` benchmark, drop the cache for every candidate at once while any one is
swamped: at 40 clients on 4 prefill engines that sent a shared-prefix workload from a 94% to
a 77% hit rate, and its TTFT p90 from 86 ms to 2.8 s, as misses fed the imbalance.)
Ties go by the role's rotation turn, as `least_in_flight` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """One candidate as the decision sees it."""

    id: str
    in_flight: int
    waiting: int | None = None  # scraped; None when stale or never scraped
    kv_usage: float | None = None  # scraped, 0..1

    @property
    def queue(self) -> int:
        return self.in_flight + (self.waiting or 0)


@dataclass(frozen=True)
class Weights:
    prefix: float = 3.0
    load: float = 1.0
    kv_usage: float = 1.0  # decode only
    imbalance_abs: int = 8
    imbalance_rel: float = 2.0


@dataclass(frozen=True)
class Ranked:
    """A candidate's place in the decision, for the request path and for the explain view."""

    id: str
    matched_tokens: int
    load: int
    score: float


def rank(
    candidates: Sequence[Load],
    matched: Mapping[str, int],
    prompt_tokens: int,
    turn: int,
    *,
    decode: bool = False,
    weights: Weights = Weights(),
) -> list[Ranked]:
    """Candidates best first. `matched` maps engine id to its cached prefix in tokens (missing:
    none); `turn` breaks ties in rotation so equal engines share the work."""
    if not candidates:
        return []
    queues = [c.queue for c in candidates]
    low, high = min(queues), max(queues)
    ranked = []
    for c in candidates:
        hit = min(matched.get(c.id, 0), prompt_tokens)
        swamped = c.queue - low > weights.imbalance_abs and c.queue > weights.imbalance_rel * low
        share = hit / prompt_tokens if prompt_tokens > 0 and not swamped else 0.0
        score = weights.prefix * share - weights.load * c.queue / (1 + high)
        if decode and c.kv_usage is not None:
            score -= weights.kv_usage * c.kv_usage
        ranked.append(Ranked(c.id, hit, c.queue, score))
    ids = sorted(r.id for r in ranked)
    order = {engine_id: (i - turn) % len(ids) for i, engine_id in enumerate(ids)}
    ranked.sort(key=lambda r: (-r.score, order[r.id]))
    return ranked
