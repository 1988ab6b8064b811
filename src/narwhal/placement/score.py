"""The placement decision: eligible engines of a role ranked by cached prefix against load.

A pure function over a snapshot (each candidate's load and matched prefix) so the request path,
`POST /admin/placement` and the benchmark's oracle all rank the same way. It only orders the
engines that eligibility already allowed (spec: drains, quarantine, last-engine protection are
decided before); it never adds one.

Prefill (and unified) engines are ranked by the prefill work the request would wait for and
then do there, in prompt tokens (the unit a GPU's prefill throughput is measured in), its own
work counted once more as what it adds to the fleet's load:

    cost = queue * (tokens_per_request + request_overhead_tokens)
           + (1 + own_work_weight) * (prompt - matched)

`queue` is what the engine holds: by its own count (scraped `vllm:num_requests_running` plus
`..._waiting`, when fresh: it sees other routers and the other workers) or Narwhal's in-flight
legs on it (they see what the last scrape has not yet), whichever is larger. (Adding the two
counted each of Narwhal's own waiting requests twice: an engine running 4 of Narwhal's
requests with 6 more waiting read as a queue of 16.) `tokens_per_request` is what the prefills
recently placed there had to compute (their uncached tokens, a moving average the caller
keeps; unknown: as much as this prompt would, on the guess that an engine's queue holds
requests like it).
So an engine holding the prefix wins until the queue in front of it costs more than computing
the prompt elsewhere; then the hot prefix spreads to a lighter engine, which holds it too from
then on: as many engines hold a hot prefix as its load needs, with no threshold to tune. The
second count of the request's own work keeps a burst of one new prefix together (the second
request waits for the first's prefill rather than computing the prompt again elsewhere, which
would finish about as soon but cost the fleet the prompt twice).
The score shown is `-cost / prompt` (higher is better). Ties go by the role's rotation turn,
as `least_in_flight` does.

(The first version scored the hit share against relative load with an imbalance guard that
dropped the cache while one engine was swamped, as sglang-router's and vllm-router's
cache-aware policies do. On the `cache` benchmark it spilled far too early: at 40 clients on 4
prefill engines a shared-prefix workload fell from 94% to 77-84% hits and its TTFT p90 from
86 ms to 1.6-2.8 s, each spilled request's miss making its new engine the swamped one.)

Decode engines: vLLM's connector pulls only the blocks a decode engine lacks, a small saving
beside a prefill; what a decode engine costs is the sequences it runs and its KV room:

    score = prefix_weight * matched / prompt  -  load / (1 + max load)  -  kv_usage

with the imbalance guard kept, per engine: a decode engine carrying more than `imbalance_abs`
legs more than the least loaded, and more than `imbalance_rel` times as many, gets no credit
for its cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Load(NamedTuple):
    """One candidate as the decision sees it (a tuple: built for every candidate of every
    leg, where a frozen dataclass's construction costs about three times as much)."""

    id: str
    in_flight: int
    held: int | None = None  # scraped running + waiting; None when stale or never scraped
    kv_usage: float | None = None  # scraped, 0..1
    # prefill: the uncached tokens of the prefills recently placed here (None: unknown)
    tokens_per_request: float | None = None

    @property
    def queue(self) -> int:
        return max(self.in_flight, self.held or 0)


@dataclass(frozen=True)
class Weights:
    # prefill: what a request costs beyond its uncached tokens (scheduling, its last token):
    # one block's worth, so a queue of fully cached requests is not free
    request_overhead_tokens: float = 16.0
    own_work_weight: float = 1.0
    # decode
    prefix: float = 3.0
    load: float = 1.0
    kv_usage: float = 1.0
    imbalance_abs: int = 8
    imbalance_rel: float = 2.0


class Ranked(NamedTuple):
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
    score = _decode_scores if decode else _prefill_scores
    ranked = score(candidates, matched, max(prompt_tokens, 0), weights)
    if len(ranked) == 1:
        return ranked
    ids = sorted(r.id for r in ranked)
    order = {engine_id: (i - turn) % len(ids) for i, engine_id in enumerate(ids)}
    ranked.sort(key=lambda r: (-r.score, order[r.id]))
    return ranked


def _prefill_scores(
    candidates: Sequence[Load], matched: Mapping[str, int], prompt: int, weights: Weights
) -> list[Ranked]:
    ranked = []
    for c in candidates:
        hit = min(matched.get(c.id, 0), prompt)
        own = prompt - hit
        per = own if c.tokens_per_request is None else c.tokens_per_request
        wait = c.queue * (per + weights.request_overhead_tokens)
        cost = wait + (1 + weights.own_work_weight) * own
        ranked.append(Ranked(c.id, hit, c.queue, -cost / max(prompt, 1)))
    return ranked


def _decode_scores(
    candidates: Sequence[Load], matched: Mapping[str, int], prompt: int, weights: Weights
) -> list[Ranked]:
    low = min(c.queue for c in candidates)
    high = max(c.queue for c in candidates)
    ranked = []
    for c in candidates:
        hit = min(matched.get(c.id, 0), prompt)
        swamped = c.queue - low > weights.imbalance_abs and c.queue > weights.imbalance_rel * low
        share = hit / prompt if prompt > 0 and not swamped else 0.0
        score = weights.prefix * share - weights.load * c.queue / (1 + high)
        if c.kv_usage is not None:
            score -= weights.kv_usage * c.kv_usage
        ranked.append(Ranked(c.id, hit, c.queue, score))
    return ranked
