"""The prefill side's KV blocks kept for a decode engine: each handoff is read at most once.

A handoff lives for `ttl_s` (monotonic clock) after the prefill stored it; reading it frees it.
Entries expire in insertion order (the TTL is fixed), so expiry is swept from the front.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from narwhal.clock import Clock
from narwhal.sim.kv import Block


class KvLoadError(Exception):
    """A handoff that cannot be read; the message says why."""


@dataclass(frozen=True, slots=True)
class _Entry:
    block_ids: tuple[int, ...]
    blocks: tuple[Block, ...]
    expires_at: float


class KvStore:
    def __init__(self, clock: Clock, ttl_s: float) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._next_block_id = 0

    def put(self, request_id: str, blocks: Sequence[Block]) -> list[int]:
        """Keep `blocks` under `request_id`; returns the block ids a decode must name."""
        self._sweep()
        first = self._next_block_id
        self._next_block_id += len(blocks)
        block_ids = tuple(range(first, self._next_block_id))
        expires_at = self._clock.monotonic() + self._ttl_s
        self._entries[request_id] = _Entry(block_ids, tuple(blocks), expires_at)
        return list(block_ids)

    def take(self, request_id: str, block_ids: Sequence[int]) -> tuple[Block, ...]:
        """Hand the blocks over and free them; raises KvLoadError if they cannot be read."""
        self._sweep()
        entry = self._entries.get(request_id)
        if entry is None:
            raise KvLoadError(f"remote_request_id {request_id!r} unknown, expired or already read")
        if tuple(block_ids) != entry.block_ids:
            raise KvLoadError(f"remote_block_ids do not match the blocks of {request_id!r}")
        del self._entries[request_id]
        return entry.blocks

    def clear(self) -> None:
        """Drop every block (the engine restarted)."""
        self._entries.clear()

    def held(self) -> int:
        """How many handoffs are waiting to be read."""
        now = self._clock.monotonic()
        return sum(1 for e in self._entries.values() if e.expires_at > now)

    def _sweep(self) -> None:
        now = self._clock.monotonic()
        while self._entries:
            request_id, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                return
            del self._entries[request_id]
