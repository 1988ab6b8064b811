"""`Placement`: the block index of every model, fed by the engines' KV events and by Narwhal's
own placements, asked for each engine's cached prefix of a prompt.

Synchronous and I/O-free (the subscriber is the edge that calls `on_batch`); time comes in as
`now`. Per engine it keeps the event stream's sequence state (stream.py) and counters, and
decides which engines are judged by the approximate tier: those without events, and those whose
stream is stale. A broken stream is counted and logged; it is never evidence against the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from narwhal.placement import stream
from narwhal.placement.events import BatchDecoder, BlockStored, DecodeError, Event
from narwhal.placement.index import ModelIndex, PrefixMatch
from narwhal.placement.keys import BlockKey, prompt_keys

log = logging.getLogger("narwhal.placement")


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    approximate_ttl_s: float = 600.0
    """How long a placement counts on an engine judged by the approximate tier."""
    speculative_ttl_s: float = 5.0
    """How long a placement counts on any engine before its events must confirm it."""
    stale_after_s: float = 10.0
    """Placed work that stored no block within this long makes the engine's stream stale."""
    replay_retry_s: float = 5.0
    """After a failed replay, gaps are given up without asking again for this long: short,
    as each gap meanwhile forgets the engine (30 s cost a multi-turn workload with 1% of its
    event messages dropped 12 points of hit rate in the cache bench)."""


@dataclass(slots=True)
class EngineCounters:
    """Per engine, since it was added; exported as metrics by the caller."""

    batches: int = 0
    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    gaps_seen: int = 0  # gaps in the live stream, replayed or given up
    gaps: int = 0  # gaps given up (the engine's entries dropped)
    missed_batches: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    duplicates: int = 0
    decode_errors: int = 0
    unkeyable_blocks: int = 0
    skipped_events: int = 0
    clears: int = 0


@dataclass(slots=True)
class _Engine:
    model: str
    capacity_tokens: int
    capacity_blocks: int
    has_events: bool
    has_replay: bool
    stream: stream.StreamState = field(default_factory=stream.StreamState)
    counters: EngineCounters = field(default_factory=EngineCounters)
    decoder: BatchDecoder = field(default_factory=BatchDecoder)

    def resize(self, capacity_tokens: int, block_size_tokens: int) -> None:
        """The cache size in tokens and in the model's blocks (at least one block)."""
        self.capacity_tokens = capacity_tokens
        self.capacity_blocks = max(1, capacity_tokens // block_size_tokens)


class Placement:
    """The facade the request path, the subscribers and the control plane share."""

    def __init__(self, config: PlacementConfig | None = None) -> None:
        self.config = config or PlacementConfig()
        self._models: dict[str, ModelIndex] = {}
        self._engines: dict[str, _Engine] = {}
        # Models whose block size was taken from their engines' events (once each).
        self._learned: set[str] = set()

    # -- membership -----------------------------------------------------------------------

    def set_engine(
        self,
        engine: str,
        *,
        model: str,
        block_size_tokens: int,
        capacity_tokens: int,
        has_events: bool,
        has_replay: bool = False,
    ) -> None:
        """Add an engine, or change its facts (a changed model starts it over empty)."""
        index = self._models.get(model)
        if index is None:
            index = ModelIndex(
                block_size_tokens,
                approximate_ttl_s=self.config.approximate_ttl_s,
                speculative_ttl_s=self.config.speculative_ttl_s,
            )
            self._models[model] = index
        elif index.block_size_tokens != block_size_tokens and model not in self._learned:
            raise ValueError(
                f"engine {engine}: block size {block_size_tokens} differs from the "
                f"{index.block_size_tokens} of the other engines of model {model}"
            )
        current = self._engines.get(engine)
        if current is not None and current.model != model:
            self.remove_engine(engine)
            current = None
        if current is None:
            current = self._engines[engine] = _Engine(model, 0, 0, has_events, has_replay)
        current.resize(capacity_tokens, index.block_size_tokens)
        current.has_events = has_events
        current.has_replay = has_replay

    def set_capacity(self, engine: str, capacity_tokens: int) -> None:
        """The engine's cache size, as it reports it: the bound of its approximate entries."""
        state = self._engines.get(engine)
        if state is not None and state.capacity_tokens != capacity_tokens:
            state.resize(capacity_tokens, self._models[state.model].block_size_tokens)

    def drop_engine(self, engine: str) -> None:
        """Hygiene: the engine holds nothing now (ejected, drained, readmitted, restarted)."""
        state = self._engines.get(engine)
        if state is None:
            return
        self._models[state.model].drop_engine(engine)
        state.stream = stream.reset(state.stream)

    def remove_engine(self, engine: str) -> None:
        """The engine left the fleet: forget it."""
        self.drop_engine(engine)
        self._engines.pop(engine, None)

    # -- events ---------------------------------------------------------------------------

    def on_batch(
        self, engine: str, seq: int, payload: bytes, now: float, *, replayed: bool = False
    ) -> stream.SeqDecision | None:
        """One published message (live, or from a replay). The decision says whether the
        caller must replay first; None: the engine is unknown, nothing was done."""
        state = self._engines.get(engine)
        if state is None:
            return None
        index = self._models[state.model]
        counters = state.counters
        state.stream, decision = stream.decide(
            state.stream,
            seq,
            replayed=replayed,
            replay_available=state.has_replay,
            now=now,
        )
        if decision.verdict is stream.Verdict.RESTART:
            counters.restarts += 1
            log.info("kv events: %s: publisher restarted (sequence %d)", engine, seq)
            index.drop_engine(engine)
        elif decision.drop_entries:
            index.clear_exact(engine)
        if decision.verdict is stream.Verdict.DUPLICATE:
            counters.duplicates += 1
        elif decision.verdict is stream.Verdict.GAP and not replayed:
            counters.gaps_seen += 1  # a gap inside a replay is the same gap, given up
        if decision.replay_from is not None:
            counters.replays += 1
        if decision.missed is not None:
            counters.gaps += 1
            counters.missed_batches += decision.missed[1] - decision.missed[0] + 1
            log.warning(
                "kv events: %s: sequences %d..%d lost; its blocks are forgotten",
                engine,
                *decision.missed,
            )
        if not decision.apply:
            return decision
        batch = state.decoder.decode(payload)
        if isinstance(batch, DecodeError):
            counters.decode_errors += 1
            log.warning("kv events: %s: undecodable batch %d (%s)", engine, seq, batch.reason)
            index.clear_exact(engine)  # its removals are lost: what we hold may be wrong
            return decision
        counters.batches += 1
        counters.events += len(batch.events)
        counters.skipped_events += batch.skipped_events
        index = self._learn_block_size(engine, state.model, batch.events)
        applied = index.apply(engine, batch.events)
        counters.stored_blocks += applied.stored_blocks
        counters.removed_blocks += applied.removed_blocks
        counters.unkeyable_blocks += applied.unkeyable_blocks
        counters.clears += int(applied.cleared)
        return decision

    def _learn_block_size(self, engine: str, model: str, events: Sequence[Event]) -> ModelIndex:
        """The engines' `--block-size` from their events, when it is not the configured one
        (`placement.block_size_tokens`): blocks of another size can never be keyed, so the
        model's index starts over in the engines' size, once; its engines' capacities are
        counted in the new blocks. A later disagreement (engines of one model with different
        block sizes) is left to the unkeyable count."""
        index = self._models[model]
        if model in self._learned:
            return index
        sizes = {
            e.block_size for e in events if isinstance(e, BlockStored) and e.group_idx in (None, 0)
        }
        if len(sizes) != 1 or index.block_size_tokens in sizes:
            return index
        (size,) = sizes
        if size < 1:
            return index
        log.warning(
            "kv events: %s publishes blocks of %d tokens, not placement.block_size_tokens %d: "
            "model %s is indexed in blocks of %d from now on (set the key to start so)",
            engine, size, index.block_size_tokens, model, size,
        )  # fmt: skip
        self._learned.add(model)
        index = self._models[model] = ModelIndex(
            size,
            approximate_ttl_s=self.config.approximate_ttl_s,
            speculative_ttl_s=self.config.speculative_ttl_s,
        )
        for state in self._engines.values():
            if state.model == model:
                state.resize(state.capacity_tokens, size)
        return index

    def block_size(self, model: str) -> int | None:
        """The block size the model is indexed in (None: an unknown model)."""
        index = self._models.get(model)
        return None if index is None else index.block_size_tokens

    def on_replay_failed(self, engine: str, now: float) -> None:
        """The replay endpoint did not answer in time or broke off."""
        state = self._engines.get(engine)
        if state is None:
            return
        state.counters.replay_failures += 1
        state.stream = stream.replay_failed(state.stream, now, self.config.replay_retry_s)

    def on_garbage(self, engine: str, reason: str) -> None:
        """A message without a usable sequence frame: counted and logged, nothing else."""
        state = self._engines.get(engine)
        if state is not None:
            state.counters.decode_errors += 1
            log.warning("kv events: %s: malformed message (%s)", engine, reason)

    # -- the request path -----------------------------------------------------------------

    def keys(
        self,
        model: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[BlockKey]:
        """The prompt's block keys in the model's block size ([] for an unknown model)."""
        index = self._models.get(model)
        if index is None:
            return []
        return prompt_keys(
            token_ids, index.block_size_tokens, lora_name=lora_name, cache_salt=cache_salt
        )

    def match(self, model: str, keys: Sequence[BlockKey], now: float) -> dict[str, PrefixMatch]:
        """Each engine's cached prefix of the prompt with these keys (absent: nothing)."""
        index = self._models.get(model)
        if index is None:
            return {}
        return index.match(keys, now, approximate=self.approximate_engines(model, now))

    def note_placed(
        self, model: str, engine: str, keys: Sequence[BlockKey], now: float, *, matched_tokens: int
    ) -> None:
        """Narwhal sent a prefill with these keys to the engine; `matched_tokens` is what the
        decision expected cached there (fewer than the keys cover: new blocks, so events due)."""
        state = self._engines.get(engine)
        index = self._models.get(model)
        if state is None or index is None or state.model != model or not keys:
            return
        index.note_placed(engine, keys, now, capacity_blocks=state.capacity_blocks)
        if state.has_events and matched_tokens < len(keys) * index.block_size_tokens:
            state.stream = stream.note_placed(state.stream, now)

    def approximate_engines(self, model: str, now: float) -> frozenset[str]:
        """The model's engines judged by Narwhal's placements: no events, or a stale stream."""
        return frozenset(
            engine
            for engine, state in self._engines.items()
            if state.model == model
            and (
                not state.has_events
                or stream.is_stale(state.stream, now, self.config.stale_after_s)
            )
        )

    # -- observation ----------------------------------------------------------------------

    def counters(self, engine: str) -> EngineCounters | None:
        state = self._engines.get(engine)
        return None if state is None else state.counters

    def is_stale(self, engine: str, now: float) -> bool:
        state = self._engines.get(engine)
        return state is not None and (
            state.has_events and stream.is_stale(state.stream, now, self.config.stale_after_s)
        )

    def index_blocks(self, engine: str) -> int:
        """`narwhal_prefix_index_blocks{engine}`: the engine's entries in all tiers."""
        state = self._engines.get(engine)
        return 0 if state is None else self._models[state.model].blocks(engine)

    def estimated_bytes(self) -> int:
        return sum(index.estimated_bytes() for index in self._models.values())
