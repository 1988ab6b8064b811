"""Cache-aware placement in one process (DESIGN §11, docs/placement.md): each request's
prompt as block keys, each candidate's cached prefix from the block index, and the ranking.

Every data-plane process (the one process, or each worker) keeps its own index, fed by its
own KV-event subscription to every engine (a ZMQ PUB socket fans out to any number of
subscribers) and by its own placements; placements are also shared (`note_placed` from the
other processes) so that a new prefix is not spread across engines before events arrive.
`sync` keeps the index's engines equal to the fleet's and applies the hygiene rules: an engine
ejected, drained, in maintenance, leaving, or readmitted with a new generation holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from narwhal.clock import Clock
from narwhal.config import Config, EngineConfig, PlacementConfig, Role
from narwhal.dataplane.requests import ClientRequest
from narwhal.fleet.holds import HoldName
from narwhal.fleet.state import Candidate, EngineState
from narwhal.fleet.store import Fleet
from narwhal.placement.facade import Placement
from narwhal.placement.index import PrefixMatch
from narwhal.placement.keys import BlockKey, InvalidTokens
from narwhal.placement.load import EngineLoad
from narwhal.placement.score import Load, Ranked, rank
from narwhal.placement.subscriber import KvEventsEndpoint, subscribe
from narwhal.placement.tokenizer import PromptTokenizer

log = logging.getLogger("narwhal.placement")

DEFAULT_CAPACITY_TOKENS = 1 << 20  # an engine's cache for the approximate index, when unknown
_OUT_HOLDS = frozenset({HoldName.OPERATOR_DRAIN, HoldName.PLANNED_MAINTENANCE})


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as placement sees it."""

    model: str  # the index it is matched in: a LoRA adapter's is its engines' model
    keys: tuple[BlockKey, ...]
    tokens: int  # the prompt's length in (pseudo) tokens


Shared = Callable[[str, str, Sequence[BlockKey]], None]
"""Tell the other processes that a prefill with these keys went to an engine."""


def _unshared(model: str, engine_id: str, keys: Sequence[BlockKey]) -> None:
    """One process: nobody else to tell."""


def events_of(engine: EngineConfig, placement: PlacementConfig) -> KvEventsEndpoint | None:
    """The engine's KV-event endpoint: its own config, else the placement ports on its host."""
    if engine.kv_events is not None:
        events = engine.kv_events
        return KvEventsEndpoint(events.endpoint, events.replay_endpoint, events.topic)
    if placement.kv_events_port is None:
        return None
    host = urlsplit(engine.url).hostname or ""
    if ":" in host:  # an IPv6 address, bracketed as ZMQ writes it
        host = f"[{host}]"
    replay = placement.kv_events_replay_port
    return KvEventsEndpoint(
        f"tcp://{host}:{placement.kv_events_port}",
        None if replay is None else f"tcp://{host}:{replay}",
    )


# How fast an engine's tokens-per-request average follows its newest prefill placement.
WORK_EWMA = 0.2
# A prefill's keys placed on an engine are told to the other processes when they are new
# there, and again only once this share of the speculative entries' life has passed: the
# others' entries stay fresh, and a hot prefix costs no frame per request.
RETELL_SHARE = 0.25


class PrefixPlacement:
    def __init__(self, config: Config, clock: Clock, share: Shared = _unshared) -> None:
        self.enabled = config.placement.policy == "prefix"
        self.index = Placement()
        self._clock = clock
        self._share = share
        self._placement_config = config.placement
        self._tokenizer = PromptTokenizer.from_config(config.placement) if self.enabled else None
        if self._tokenizer is not None:
            models = {config.model} | {e.model for e in config.engines if e.model is not None}
            for model in sorted(models - set(config.placement.tokenizers)):
                # A warning only where engines publish events that go unused for want of it.
                publishing = config.placement.kv_events_port is not None or any(
                    e.kv_events is not None and (e.model or config.model) == model
                    for e in config.engines
                )
                log.log(
                    logging.WARNING if publishing else logging.DEBUG,
                    "placement: model %s has no placement.tokenizers entry: placed by text "
                    "blocks over Narwhal's own placements (its engines' KV events cannot be "
                    "keyed)",
                    model,
                )
        self._seen: dict[str, tuple[bool, float | None]] = {}  # engine: (out, generation)
        # Each engine's own load, from its /metrics (control/load_scrape.py); replaced whole.
        self.loads: Mapping[str, EngineLoad] = {}
        # Engines whose cache size the scrape may set (no `engines[].kv_capacity_tokens`).
        self._scraped_capacity: set[str] = set()
        self._endpoints: dict[str, KvEventsEndpoint] = {}
        # Per engine: the uncached tokens of the prefills this process placed there lately (a
        # moving average), what `score.rank` charges for each request in its queue.
        self._work: dict[str, float] = {}
        # (model, engine, the prompt's last key: its whole chain) -> when it was last told.
        self._told: dict[tuple[str, str, BlockKey], float] = {}
        self._retell_s = self.index.config.speculative_ttl_s * RETELL_SHARE
        # A LoRA adapter's name -> its engines' model: its blocks live in that model's index,
        # keyed from the adapter's root (vLLM keys them by the adapter's name).
        self._adapter_of: dict[str, str] = {}

    # ------------------------------------------------------------ membership and hygiene
    def sync(self, engines: Iterable[EngineState], now: float) -> None:
        """The fleet as it is now: engines added, removed, and dropped by the hygiene rules."""
        if not self.enabled:
            return
        emptied: set[str] = set()  # the others empty it too: what was told is to tell again
        present = set()
        adapter_of: dict[str, str] = {}
        for engine in engines:
            if engine.role is Role.EMBED:
                continue
            present.add(engine.id)
            config = engine.config
            for adapter in engine.adapters:
                adapter_of[adapter] = config.model or ""
            endpoint = events_of(config, self._placement_config)
            if self._tokenizer is None or self._tokenizer.model(config.model or "") is None:
                # The engine's events carry its token ids; without the model's tokenizer the
                # router's keys (over text) can never equal them: approximate index only.
                endpoint = None
            if engine.id not in self._seen:
                if config.kv_capacity_tokens is None:
                    self._scraped_capacity.add(engine.id)
                self.index.set_engine(
                    engine.id,
                    model=config.model or "",
                    block_size_tokens=self._placement_config.block_size_tokens,
                    capacity_tokens=config.kv_capacity_tokens or DEFAULT_CAPACITY_TOKENS,
                    has_events=endpoint is not None,
                    has_replay=endpoint is not None and endpoint.replay_endpoint is not None,
                )
            out = (
                engine.ejected is not None
                or engine.leaving is not None
                or any(h.name in _OUT_HOLDS for h in engine.active_holds(now))
            )
            before = self._seen.get(engine.id)
            # A generation first learned (None before: llama.cpp's is known only once the
            # engine has answered) is not a restart; one that changes is.
            restarted = (
                before is not None and before[1] is not None and before[1] != engine.generation
            )
            if before is not None and ((out and not before[0]) or restarted):
                log.info("placement: %s holds nothing now (out or a new generation)", engine.id)
                self.index.drop_engine(engine.id)
                emptied.add(engine.id)
            self._seen[engine.id] = (out, engine.generation)
            if endpoint is not None:
                self._endpoints[engine.id] = endpoint
            else:
                self._endpoints.pop(engine.id, None)
        for gone in set(self._seen) - present:
            self.index.remove_engine(gone)
            emptied.add(gone)
            del self._seen[gone]
            self._scraped_capacity.discard(gone)
            self._endpoints.pop(gone, None)
        self._told = {
            told: at
            for told, at in self._told.items()
            if now - at < self._retell_s and told[1] not in emptied
        }
        self._adapter_of = adapter_of

    def set_loads(self, loads: Mapping[str, EngineLoad]) -> None:
        """The engines' scraped loads; a reported cache size bounds the engine's approximate
        entries, unless `engines[].kv_capacity_tokens` says otherwise."""
        self.loads = loads
        for engine, load in loads.items():
            if load.capacity_tokens is not None and engine in self._scraped_capacity:
                self.index.set_capacity(engine, load.capacity_tokens)

    def engines(self) -> list[str]:
        """The engines the index follows."""
        return sorted(self._seen)

    async def run(self, fleet: Callable[[], Iterable[EngineState]], interval_s: float) -> None:
        """Until cancelled: every `interval_s`, `sync` with the fleet, and keep one subscriber
        task per engine with events (started, restarted when its endpoint changes or its task
        ended, stopped when the engine left)."""
        if not self.enabled:
            return
        context = zmq.asyncio.Context()
        tasks: dict[str, tuple[KvEventsEndpoint, asyncio.Task[None]]] = {}
        try:
            while True:
                self.sync(fleet(), self._clock.monotonic())
                for engine_id, (endpoint, task) in list(tasks.items()):
                    if self._endpoints.get(engine_id) != endpoint or task.done():
                        task.cancel()
                        del tasks[engine_id]
                for engine_id, endpoint in self._endpoints.items():
                    if engine_id not in tasks:
                        task = asyncio.create_task(
                            subscribe(
                                engine_id, endpoint, self.index, context=context, clock=self._clock
                            ),
                            name=f"kv-events-{engine_id}",
                        )
                        tasks[engine_id] = (endpoint, task)
                await self._clock.sleep(interval_s)
        finally:
            for _, task in tasks.values():
                task.cancel()
            await asyncio.gather(*(t for _, t in tasks.values()), return_exceptions=True)
            context.term()

    # ------------------------------------------------------------ the request path
    async def prompt(self, req: ClientRequest, model: str) -> Prompt | None:
        """The request's block keys (None: placement by load only). A long prompt is encoded
        off the event loop (`PromptTokenizer.chat_async`, `completion_async`)."""
        if self._tokenizer is None:
            return None
        body: dict[str, Any] = req.body
        indexed, lora, tokenizer = self._names(model)
        if req.endpoint == "chat":
            tokens = await self._tokenizer.chat_async(tokenizer, body)
        else:
            text = _completion_prompt(body)
            if text is None:
                return None
            tokens = await self._tokenizer.completion_async(tokenizer, text)
        return self._keyed(indexed, lora, tokens.ids, body)

    def prompt_now(self, req: ClientRequest, model: str) -> Prompt | None:
        """`prompt`, all on the event loop (`/admin/placement`'s explanation)."""
        if self._tokenizer is None:
            return None
        body: dict[str, Any] = req.body
        indexed, lora, tokenizer = self._names(model)
        if req.endpoint == "chat":
            tokens = self._tokenizer.chat(tokenizer, body)
        else:
            text = _completion_prompt(body)
            if text is None:
                return None
            tokens = self._tokenizer.completion(tokenizer, text)
        return self._keyed(indexed, lora, tokens.ids, body)

    def _names(self, model: str) -> tuple[str, str | None, str]:
        """The requested model's index, LoRA name and tokenizer: a LoRA adapter is indexed
        with its engines' model under its own name, tokenized by its own
        `placement.tokenizers` entry, else its model's (an adapter keeps its base's
        vocabulary); any other model is itself, without a LoRA name."""
        base = self._adapter_of.get(model)
        if base is None:
            return model, None, model
        assert self._tokenizer is not None
        return base, model, model if self._tokenizer.model(model) is not None else base

    def _keyed(
        self, model: str, lora: str | None, ids: Sequence[int], body: dict[str, Any]
    ) -> Prompt | None:
        """The prompt's keys; None (placed by load) for token ids no engine has (negative, or
        past 32 bits): the engine answers those with its own 400."""
        try:
            keys = tuple(self.index.keys(model, ids, lora_name=lora, cache_salt=_salt(body)))
        except InvalidTokens:
            return None
        return Prompt(model, keys, len(ids))

    def match(self, prompt: Prompt) -> dict[str, PrefixMatch]:
        """Each engine's cached prefix of the prompt, from the index now."""
        return self.index.match(prompt.model, prompt.keys, self._clock.monotonic())

    def choose(
        self,
        prompt: Prompt,
        role: Role,
        candidates: Sequence[Candidate],
        turn: int,
        exclude: Collection[str] = (),
        matched: Mapping[str, PrefixMatch] | None = None,
    ) -> list[Ranked]:
        """The candidates best first, those in `exclude` last. `matched`: the prompt's
        `match`, when the caller looked it up already (outside the placement claim's lock)."""
        now = self._clock.monotonic()
        if matched is None:
            matched = self.index.match(prompt.model, prompt.keys, now)
        loads = [self.load(c, now) for c in candidates]
        hits = {engine: m.matched_tokens for engine, m in matched.items()}
        ranked = rank(loads, hits, prompt.tokens, turn, decode=role is Role.DECODE)
        if not any(r.id in exclude for r in ranked):
            return ranked
        return [r for r in ranked if r.id not in exclude] + [r for r in ranked if r.id in exclude]

    def load(self, candidate: Candidate, now: float) -> Load:
        """Narwhal's in-flight legs, and the engine's own count and KV usage while fresh."""
        scraped = self.loads.get(candidate.id)
        work = self._work.get(candidate.id)
        if scraped is None or not scraped.fresh(now, self._placement_config.metrics_stale_s):
            return Load(candidate.id, candidate.in_flight, tokens_per_request=work)
        held = scraped.running + scraped.waiting
        return Load(candidate.id, candidate.in_flight, held, scraped.kv_usage, work)

    def explain(self, req: ClientRequest, model: str, fleet: Fleet, now: float) -> dict[str, Any]:
        """`POST /admin/placement`: how this process would place the request now, without
        running it (each role's eligible engines best first, with matched tokens and score)."""
        prompt = self.prompt_now(req, model)
        roles = fleet.needed_roles(model)
        view: dict[str, Any] = {
            "model": model,
            "prompt_tokens": prompt.tokens if prompt else None,
            "prefill": [],
            "decode": [],
        }
        chosen: dict[str, str | None] = {"prefill": None, "decode": None}
        for role in roles:
            candidates = fleet.candidates(role, now, model)
            if prompt is not None:
                ranked = self.choose(prompt, role, candidates, turn=0)
            else:  # least_loaded: no keys; ranked by load alone
                loads = [self.load(c, now) for c in candidates]
                ranked = rank(loads, {}, 0, 0)
            name = "prefill" if role in (Role.PREFILL, Role.BOTH) else role.value
            view[name] = [
                {"id": r.id, "matched_tokens": r.matched_tokens, "score": round(r.score, 4)}
                for r in ranked
            ]
            chosen[name] = ranked[0].id if ranked else None
            if role is Role.BOTH:  # a unified engine runs the decode where it prefilled
                view["decode"], chosen["decode"] = view["prefill"], chosen["prefill"]
        view["chosen"] = chosen
        return view

    def placed(
        self, prompt: Prompt, engine_id: str, matched_tokens: int, *, prefill: bool = True
    ) -> None:
        """A leg with the prompt's keys went to `engine_id`: speculative until its events
        confirm it. A prefill's pick is told to the other processes too, when it is new to
        them (`RETELL_SHARE`); a decode's is not (its prefix earns a decode engine little
        beside its load, `score`). Each telling costs a frame to the control process and one
        to each other worker, and wakes each of them."""
        now = self._clock.monotonic()
        self.index.note_placed(
            prompt.model, engine_id, prompt.keys, now, matched_tokens=matched_tokens
        )
        if not prefill:  # nor is a decode's queue charged in tokens (`score`)
            return
        if prompt.keys:
            told = (prompt.model, engine_id, prompt.keys[-1])
            last = self._told.get(told)
            if last is None or now - last >= self._retell_s:
                self._told[told] = now
                self._share(prompt.model, engine_id, prompt.keys)
        uncached = max(prompt.tokens - matched_tokens, 0)
        before = self._work.get(engine_id)
        self._work[engine_id] = (
            uncached if before is None else before + WORK_EWMA * (uncached - before)
        )

    def placed_elsewhere(self, model: str, engine_id: str, keys: Sequence[BlockKey]) -> None:
        """Another process placed a prefill (its `share`)."""
        now = self._clock.monotonic()
        # Its events are this process's to expect only if it expected new blocks: not known here.
        covered = len(keys) * (self.index.block_size(model) or 0)
        self.index.note_placed(model, engine_id, keys, now, matched_tokens=covered)


def _completion_prompt(body: dict[str, Any]) -> str | list[int] | None:
    """A completions body's prompt as placement keys it: the text or token ids; of a list of
    prompts, the first (a batch's parts are placed one by one; `["text"]` is one prompt);
    None for anything else."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    return None


def _salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) else None


class PlacementCollector:
    """The index's state as metrics (DESIGN §11), read at scrape time from the control
    process's own index (which subscribes like every data-plane process does, so it counts
    each event once however many workers there are)."""

    def __init__(self, prefix: PrefixPlacement) -> None:
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        index = self._prefix.index
        blocks = GaugeMetricFamily(
            "narwhal_prefix_index_blocks",
            "Blocks the placement index holds for each engine (exact, approximate and speculative)",
            labels=["engine"],
        )
        events = CounterMetricFamily(
            "narwhal_kv_events",
            "KV events received from each engine's publisher",
            labels=["engine"],
        )
        gaps = CounterMetricFamily(
            "narwhal_kv_event_gaps",
            "Sequence gaps in each engine's live KV-event stream (replayed or dropped)",
            labels=["engine"],
        )
        replays = CounterMetricFamily(
            "narwhal_kv_event_replays",
            "Replays asked of each engine's replay endpoint (a gap, or a late subscription)",
            labels=["engine"],
        )
        ingested = CounterMetricFamily(
            "narwhal_kv_event_blocks",
            "Blocks stored and removed by each engine's KV events, as applied to the index",
            labels=["engine"],
        )
        for engine in self._prefix.engines():
            counters = index.counters(engine)
            if counters is None:
                continue
            blocks.add_metric([engine], index.index_blocks(engine))
            events.add_metric([engine], counters.events)
            gaps.add_metric([engine], counters.gaps_seen)
            replays.add_metric([engine], counters.replays)
            ingested.add_metric([engine], counters.stored_blocks + counters.removed_blocks)
        yield blocks
        yield events
        yield gaps
        yield replays
        yield ingested
        yield GaugeMetricFamily(
            "narwhal_prefix_index_bytes",
            "The placement index's memory in one process (the control process's; each worker "
            "holds its own copy), estimated from its entries (about 380 bytes an exact block, "
            "315 an approximate or speculative one)",
            value=index.estimated_bytes(),
        )
