"""An engine's block-level prefix cache, as vLLM's: what a prompt finds cached, what it costs.

A prompt is cut into blocks of `block_size` tokens; each full block is keyed by a chained hash
(the previous block's key, its tokens, and its extra keys: the LoRA name on every block, the
cache salt on the first), seeded per process as vLLM's `PYTHONHASHSEED`: two engines never
share keys, so a router must not depend on them.

A request's life: `allocate` (at admission: the longest cached prefix is referenced, blocks are
reserved for the rest, evicting unreferenced cached blocks least recently used first), `store`
(after its prefill: its computed full blocks enter the cache) and `release` (when it ends: its
blocks become evictable, the prompt's tail before its head). Every change that a KV-event
subscriber must see comes back as events. Pure: no I/O, no clock (LRU is by order).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from narwhal.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass(frozen=True, slots=True)
class BlockExtras:
    """What besides the tokens keys a prompt's blocks (vLLM's extra keys)."""

    lora_name: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None

    def for_block(self, index: int) -> tuple[str, ...] | None:
        keys = ((self.lora_name,) if self.lora_name else ()) + (
            (self.cache_salt,) if self.cache_salt and index == 0 else ()
        )
        return keys or None


@dataclass(slots=True)
class _Block:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    refs: int = 0


@dataclass(slots=True)
class Allocation:
    """One request's hold on the cache: referenced cached blocks and reserved ones."""

    keys: tuple[bytes, ...]  # the prompt's full blocks
    tokens: tuple[int, ...]
    hit_blocks: int
    block_size: int
    extras: BlockExtras
    generation: int
    reserved: int  # blocks held but not (yet) in the cache: to compute, or the partial tail
    referenced: list[bytes] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    def tokens_of(self, index: int) -> tuple[int, ...]:
        return self.tokens[index * self.block_size : (index + 1) * self.block_size]


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int, seed: bytes) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be > 0")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._seed = seed
        self._blocks: dict[bytes, _Block] = {}
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # refs == 0, oldest first
        self._referenced = 0  # cached blocks with refs > 0
        self._reserved = 0
        self._generation = 0  # bumped by `clear`: older allocations hold no cached blocks
        self.queried_tokens = 0
        self.hit_tokens = 0

    # --- keys -------------------------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int], extras: BlockExtras) -> list[bytes]:
        """The chained keys of the prompt's full blocks."""
        keys: list[bytes] = []
        parent = b""
        size = self.block_size
        for index in range(len(token_ids) // size):
            h = hashlib.blake2b(key=self._seed, digest_size=32)
            h.update(parent)
            h.update(array("Q", token_ids[index * size : (index + 1) * size]).tobytes())
            if extra := extras.for_block(index):
                h.update(repr(extra).encode())
            parent = h.digest()
            keys.append(parent)
        return keys

    # --- a request's life -------------------------------------------------------------------

    def allocate(
        self, token_ids: Sequence[int], extras: BlockExtras = BlockExtras()
    ) -> tuple[Allocation, list[KvEvent]] | None:
        """Reference the longest cached prefix and reserve blocks for the rest; None when the
        free and evictable blocks cannot hold it now. At least the prompt's last token is
        computed, so a prompt of whole blocks hits at most all but its last block."""
        keys = self.block_keys(token_ids, extras)
        size = self.block_size
        total = -(-len(token_ids) // size)
        hit = self._hit_blocks(keys, len(token_ids))
        needed = total - hit
        idle_hits = sum(1 for k in keys[:hit] if self._blocks[k].refs == 0)
        if needed > self._free() + len(self._evictable) - idle_hits:
            return None
        alloc = Allocation(
            tuple(keys), tuple(token_ids), hit, size, extras, self._generation, reserved=0
        )
        for key in keys[:hit]:
            self._ref(key)
            alloc.referenced.append(key)
        events = self._make_room(needed)
        self._reserved += needed
        alloc.reserved = needed
        self.queried_tokens += len(token_ids)
        self.hit_tokens += alloc.hit_tokens
        return alloc, events

    def match(self, token_ids: Sequence[int], extras: BlockExtras = BlockExtras()) -> int:
        """The tokens a request for this prompt would find cached now (nothing referenced or
        counted): what the benchmark's oracle places by."""
        keys = self.block_keys(token_ids, extras)
        return self._hit_blocks(keys, len(token_ids)) * self.block_size

    def _hit_blocks(self, keys: list[bytes], prompt_tokens: int) -> int:
        limit = min(len(keys), max(0, (prompt_tokens - 1) // self.block_size))
        hit = 0
        while hit < limit and keys[hit] in self._blocks:
            hit += 1
        return hit

    def store(self, alloc: Allocation) -> list[KvEvent]:
        """The request's computed full blocks enter the cache (one `BlockStored` per run of
        new blocks); a block another request cached meanwhile is shared, not stored twice."""
        if alloc.generation != self._generation:
            return []
        events: list[KvEvent] = []
        run: list[bytes] = []
        start = len(alloc.referenced)

        def flush(index: int) -> None:
            if run:
                parent = alloc.keys[index - len(run) - 1] if index - len(run) > 0 else None
                tokens = tuple(t for k in run for t in self._blocks[k].tokens)
                extras = [alloc.extras.for_block(index - len(run) + i) for i in range(len(run))]
                events.append(
                    BlockStored(
                        block_hashes=tuple(run),
                        parent_block_hash=parent,
                        token_ids=tokens,
                        block_size=self.block_size,
                        lora_id=alloc.extras.lora_id,
                        lora_name=alloc.extras.lora_name,
                        extra_keys=tuple(extras) if any(extras) else None,
                    )
                )
                run.clear()

        for index in range(start, len(alloc.keys)):
            key = alloc.keys[index]
            alloc.reserved -= 1
            self._reserved -= 1
            if key in self._blocks:
                flush(index)
            else:
                parent = alloc.keys[index - 1] if index else None
                self._blocks[key] = _Block(key, parent, alloc.tokens_of(index))
                run.append(key)
            self._ref(key)
            alloc.referenced.append(key)
        flush(len(alloc.keys))
        return events

    def release(self, alloc: Allocation) -> None:
        """The request ended: its cached blocks become evictable, tail first; reserved blocks
        are free again."""
        self._reserved -= alloc.reserved
        alloc.reserved = 0
        if alloc.generation != self._generation:
            self._reserved -= len(alloc.referenced)  # un-cached by `clear`, held until now
        else:
            for key in reversed(alloc.referenced):
                self._unref(key)
        alloc.referenced.clear()

    def clear(self) -> list[KvEvent]:
        """Drop every cached block (vLLM's reset_prefix_cache). Blocks of running requests
        stay in use, uncached, until they end."""
        self._reserved += self._referenced
        self._referenced = 0
        self._blocks.clear()
        self._evictable.clear()
        self._generation += 1
        return [AllBlocksCleared()]

    # --- introspection ----------------------------------------------------------------------

    def usage(self) -> float:
        """The share of blocks in use by requests (vLLM's kv_cache_usage_perc, 0-1); cached
        blocks no request holds count as free."""
        return (self._referenced + self._reserved) / self.capacity_blocks

    def cached_blocks(self) -> int:
        return len(self._blocks)

    def is_cached(self, key: bytes) -> bool:
        return key in self._blocks

    # --- internals --------------------------------------------------------------------------

    def _free(self) -> int:
        return self.capacity_blocks - self._referenced - self._reserved - len(self._evictable)

    def _ref(self, key: bytes) -> None:
        block = self._blocks[key]
        if block.refs == 0:
            self._evictable.pop(key, None)
            self._referenced += 1
        block.refs += 1

    def _unref(self, key: bytes) -> None:
        block = self._blocks[key]
        block.refs -= 1
        if block.refs == 0:
            self._referenced -= 1
            self._evictable[key] = None

    def _make_room(self, needed: int) -> list[KvEvent]:
        evicted: list[bytes] = []
        while self._free() < needed:
            key, _ = self._evictable.popitem(last=False)
            del self._blocks[key]
            evicted.append(key)
        return [BlockRemoved(tuple(evicted))] if evicted else []
