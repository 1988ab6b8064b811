"""The block index of one model: which engine holds which Narwhal block keys.

Three tiers, all keyed by Narwhal's block keys (keys.py):
- exact: what the engines' KV events say they hold, per medium (GPU, or offloaded to CPU/disk),
  with the engine-hash -> key map that lets a `BlockRemoved` find its entry, and a count per
  engine hash and medium (vLLM caches a block twice when two requests fill it at once, and reports
  each copy's store and eviction);
- approximate: what Narwhal placed on each engine, LRU-bounded by the engine's capacity and
  expiring after a TTL; used for engines without events, or whose stream is stale;
- speculative: every placement, for a few seconds, until the engine's events confirm it.
The last two are one table of placements (`_Placed`: each entry the time of its key's last
placement on the engine), read with two TTLs: a placement is one update, not two.

`match` walks the prompt's keys once: O(prompt blocks x engines still matching), never O(index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from narwhal.placement.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
)
from narwhal.placement.keys import BlockKey, InvalidTokens, chain_keys, root_key

GPU = 1
OFFLOADED = 2

# Measured with tracemalloc (bench/placement_bench.py, CPython 3.11, 64-bit): the dictionary
# slots, the key ints and the per-hash entry of one block, amortised over many blocks.
EXACT_BYTES_PER_BLOCK = 380
EXPIRING_BYTES_PER_BLOCK = 315

# Placements are expired (their memory freed) on a placement at most this often: not on each
# one, where the walk over every engine's LRU cost a few microseconds of every request.
EXPIRE_EVERY_S = 1.0


def medium_bit(medium: str | None) -> int:
    """GPU (vLLM says None or "GPU") or offloaded (anything else: CPU, disk, a connector's tier)."""
    return GPU if medium is None or medium.upper() == MEDIUM_GPU else OFFLOADED


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt an engine holds, as a prefix of whole blocks."""

    matched_tokens: int
    """The longest prefix held in any tier and medium."""
    gpu_tokens: int
    """The longest prefix held on the GPU (approximate and speculative entries count as GPU)."""

    def weighted_tokens(self, offload_weight: float) -> float:
        """GPU-held tokens count fully, tokens only offloaded count `offload_weight` each."""
        return self.gpu_tokens + offload_weight * (self.matched_tokens - self.gpu_tokens)


@dataclass(slots=True)
class ApplyCounts:
    """What applying one batch did, for the engine's counters."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    unkeyable_blocks: int = 0
    """Stored blocks whose parent is unknown (after a gap or before subscribing), or whose
    tokens or block size do not fit: they cannot be keyed and are dropped."""
    unknown_removals: int = 0
    other_groups: int = 0
    """Events of a KV-cache group other than the first (hybrid models): not indexed."""
    cleared: bool = False


class _Exact:
    """One engine's exact entries: engine hash -> [key, GPU copies, offloaded copies]."""

    __slots__ = ("by_hash",)

    def __init__(self) -> None:
        self.by_hash: dict[EngineHash, list[int]] = {}


class _Placed:
    """Narwhal's placements: per key, per engine, when it was last placed there; per engine an
    LRU bounded by its capacity, forgotten `ttl_s` (the approximate TTL, the longer) after."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.holders: dict[BlockKey, dict[str, float]] = {}
        self._lru: dict[str, OrderedDict[BlockKey, float]] = {}
        self._expired_at = float("-inf")

    def add(self, engine: str, keys: Sequence[BlockKey], now: float, capacity_blocks: int) -> None:
        lru = self._lru.get(engine)
        if lru is None:
            lru = self._lru[engine] = OrderedDict()
        holders = self.holders
        # Deepest block first, so that the prompt's first blocks are the most recently used:
        # eviction takes a prefix's tail before its head, as an engine's own LRU does.
        for key in reversed(keys):
            lru[key] = now
            lru.move_to_end(key)
            engines = holders.get(key)
            if engines is None:
                holders[key] = {engine: now}
            else:
                engines[engine] = now
        while len(lru) > capacity_blocks:
            key, _ = lru.popitem(last=False)
            self._unhold(key, engine)
        if now - self._expired_at >= EXPIRE_EVERY_S:
            self.expire(now)

    def expire(self, now: float) -> None:
        """Forget what expired (each engine's LRU is in placement order: O(expired)). Only
        memory: `match` reads each entry's age, expired or not."""
        self._expired_at = now
        oldest = now - self.ttl_s
        for engine, lru in self._lru.items():
            while lru:
                key, placed = next(iter(lru.items()))
                if placed > oldest:
                    break
                lru.popitem(last=False)
                self._unhold(key, engine)

    def drop(self, engine: str) -> None:
        for key in self._lru.pop(engine, OrderedDict()):
            self._unhold(key, engine)

    def blocks(self, engine: str | None = None) -> int:
        if engine is None:
            return sum(len(lru) for lru in self._lru.values())
        return len(self._lru.get(engine, ()))

    def _unhold(self, key: BlockKey, engine: str) -> None:
        holders = self.holders.get(key)
        if holders is not None:
            holders.pop(engine, None)
            if not holders:
                del self.holders[key]


class ModelIndex:
    """The index of one model's engines (one block size: the engines' `--block-size`)."""

    def __init__(
        self, block_size_tokens: int, *, approximate_ttl_s: float, speculative_ttl_s: float
    ) -> None:
        if block_size_tokens < 1:
            raise ValueError(f"block size must be at least 1 token, got {block_size_tokens}")
        self.block_size_tokens = block_size_tokens
        self._holders: dict[BlockKey, dict[str, int]] = {}
        self._exact: dict[str, _Exact] = {}
        self._approximate_ttl_s = approximate_ttl_s
        self._speculative_ttl_s = speculative_ttl_s
        # Both TTLs' entries in one table, kept for the longer of the two.
        self._placed = _Placed(max(approximate_ttl_s, speculative_ttl_s))

    # -- exact: an engine's events --------------------------------------------------------

    def apply(self, engine: str, events: Iterable[Event]) -> ApplyCounts:
        """Apply one batch of the engine's events, in order."""
        counts = ApplyCounts()
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(engine, event, counts)
            elif isinstance(event, BlockRemoved):
                self._removed(engine, event, counts)
            elif isinstance(event, AllBlocksCleared):
                self.drop_engine(engine)
                counts.cleared = True
        return counts

    def _stored(self, engine: str, event: BlockStored, counts: ApplyCounts) -> None:
        n = len(event.block_hashes)
        if event.group_idx not in (None, 0):
            counts.other_groups += n
            return
        exact = self._exact.setdefault(engine, _Exact())
        if event.parent_block_hash is None:
            lora = event.lora_name
            if lora is None and event.lora_id is not None:
                lora = f"lora-id:{event.lora_id}"  # an old vLLM: never matches a named adapter
            parent: BlockKey | None = root_key(lora)
        else:
            entry = exact.by_hash.get(event.parent_block_hash)
            parent = None if entry is None else entry[0]
        if parent is None or event.block_size != self.block_size_tokens:
            counts.unkeyable_blocks += n
            return
        try:
            keys = chain_keys(
                parent,
                event.token_ids,
                event.block_size,
                _extras(event.extra_keys, event.lora_name),
            )
        except InvalidTokens:
            counts.unkeyable_blocks += n
            return
        bit = medium_bit(event.medium)
        copies = 1 if bit == GPU else 2
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            entry = exact.by_hash.get(engine_hash)
            if entry is None or entry[0] != key:
                entry = [key, 0, 0]
                exact.by_hash[engine_hash] = entry
            entry[copies] += 1
            holders = self._holders.setdefault(key, {})
            holders[engine] = holders.get(engine, 0) | bit
        counts.stored_blocks += len(keys)
        counts.unkeyable_blocks += n - len(keys)

    def _removed(self, engine: str, event: BlockRemoved, counts: ApplyCounts) -> None:
        if event.group_idx not in (None, 0):
            counts.other_groups += len(event.block_hashes)
            return
        exact = self._exact.get(engine)
        bit = medium_bit(event.medium)
        copies = 1 if bit == GPU else 2
        for engine_hash in event.block_hashes:
            entry = None if exact is None else exact.by_hash.get(engine_hash)
            if exact is None or entry is None or entry[copies] == 0:
                counts.unknown_removals += 1
                continue
            entry[copies] -= 1
            counts.removed_blocks += 1
            if entry[copies] > 0:
                continue
            key = entry[0]
            holders = self._holders.get(key)
            if holders is not None and engine in holders:
                mask = holders[engine] & ~bit
                if mask:
                    holders[engine] = mask
                else:
                    del holders[engine]
                    if not holders:
                        del self._holders[key]
            if entry[1] == 0 and entry[2] == 0:
                del exact.by_hash[engine_hash]

    def clear_exact(self, engine: str) -> None:
        """Forget the engine's exact entries (a gap that could not be replayed, garbage)."""
        exact = self._exact.pop(engine, None)
        if exact is None:
            return
        for entry in exact.by_hash.values():
            holders = self._holders.get(entry[0])
            if holders is not None:
                holders.pop(engine, None)
                if not holders:
                    del self._holders[entry[0]]

    def drop_engine(self, engine: str) -> None:
        """The engine holds nothing (cleared, restarted, ejected, removed): every tier."""
        self.clear_exact(engine)
        self._placed.drop(engine)

    # -- approximate and speculative: Narwhal's placements --------------------------------

    def note_placed(
        self, engine: str, keys: Sequence[BlockKey], now: float, *, capacity_blocks: int
    ) -> None:
        """Narwhal placed a prompt with these keys on the engine."""
        self._placed.add(engine, keys, now, capacity_blocks)

    def expire(self, now: float) -> None:
        self._placed.expire(now)

    # -- lookup ---------------------------------------------------------------------------

    def match(
        self, keys: Sequence[BlockKey], now: float, *, approximate: Collection[str] = ()
    ) -> dict[str, PrefixMatch]:
        """Each engine's longest held prefix of `keys`; engines in `approximate` are judged by
        Narwhal's placements instead of their events. Engines holding nothing are absent."""
        if not keys:
            return {}
        any_blocks: dict[str, int] = {}  # engine -> blocks matched, set when its run ends
        gpu_blocks: dict[str, int] = {}
        alive: dict[str, bool] = {}  # engine -> its prefix so far is all on the GPU
        exact_holders = self._holders
        placed_holders = self._placed.holders
        # A placement counts while younger than the speculative TTL on every engine, and the
        # approximate TTL on an engine judged by placements.
        spec_after = now - self._speculative_ttl_s
        approx_after = min(now - self._approximate_ttl_s, spec_after)
        position = 0
        for position, key in enumerate(keys):
            exact = exact_holders.get(key)
            placed = placed_holders.get(key)
            if position == 0:
                if exact:
                    for engine, mask in exact.items():
                        if engine not in approximate:
                            alive[engine] = bool(mask & GPU)
                if placed:
                    for engine, when in placed.items():
                        if when > (approx_after if engine in approximate else spec_after):
                            alive[engine] = True
            elif placed is None:  # the common case: events only
                for engine, on_gpu in list(alive.items()):
                    mask = 0 if exact is None else exact.get(engine, 0)
                    if not mask or engine in approximate:
                        del alive[engine]
                        any_blocks[engine] = position
                        if on_gpu:
                            gpu_blocks[engine] = position
                    elif on_gpu and not mask & GPU:
                        alive[engine] = False
                        gpu_blocks[engine] = position
            else:
                for engine, on_gpu in list(alive.items()):
                    at = placed.get(engine)
                    if at is not None and at > spec_after:
                        continue  # speculative: held, on the GPU
                    if engine in approximate:
                        held = gpu = at is not None and at > approx_after
                    else:
                        mask = 0 if exact is None else exact.get(engine, 0)
                        held, gpu = mask != 0, bool(mask & GPU)
                    if not held:
                        del alive[engine]
                        any_blocks[engine] = position
                        if on_gpu:
                            gpu_blocks[engine] = position
                    elif on_gpu and not gpu:
                        alive[engine] = False
                        gpu_blocks[engine] = position
            if not alive:
                break
        else:
            position = len(keys)
        for engine, on_gpu in alive.items():
            any_blocks[engine] = position
            if on_gpu:
                gpu_blocks[engine] = position
        size = self.block_size_tokens
        return {
            engine: PrefixMatch(blocks * size, gpu_blocks.get(engine, 0) * size)
            for engine, blocks in any_blocks.items()
            if blocks
        }

    # -- size -----------------------------------------------------------------------------

    def blocks(self, engine: str | None = None) -> int:
        """Entries in all tiers (for one engine, or all)."""
        if engine is None:
            exact = sum(len(e.by_hash) for e in self._exact.values())
        else:
            exact = len(self._exact[engine].by_hash) if engine in self._exact else 0
        return exact + self._placed.blocks(engine)

    def estimated_bytes(self) -> int:
        exact = sum(len(e.by_hash) for e in self._exact.values())
        expiring = self._placed.blocks()
        return exact * EXACT_BYTES_PER_BLOCK + expiring * EXPIRING_BYTES_PER_BLOCK


def _extras(
    extra_keys: Sequence[tuple[object, ...] | None] | None, lora_name: str | None
) -> list[tuple[object, ...] | None] | None:
    """The event's per-block extra keys without the LoRA name (that one is in the root key):
    what remains is the cache salt on the first block, and multimodal identifiers."""
    if not extra_keys:
        return None
    extras: list[tuple[object, ...] | None] = []
    found = False
    for extra in extra_keys:
        kept = None if not extra else tuple(x for x in extra if x != lora_name)
        extras.append(kept or None)
        found = found or bool(kept)
    return extras if found else None
