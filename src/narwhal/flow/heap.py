"""A heap of keys by rank, with changeable ranks: what the wait queue orders clients with.

Changing or removing a key's rank pushes or forgets it in O(1) and leaves the old heap item
behind, skipped when it reaches the top; the heap is rebuilt from the live keys once stale
items outnumber them, so every operation is O(log n) amortised.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
Rank = tuple[float, ...]

_COMPACT_MIN = 64


class KeyedHeap(Generic[K]):
    """Each key at most once; `peek` gives the key of least rank (ties: the one set first)."""

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._live: dict[K, tuple[Rank, int]] = {}
        self._heap: list[tuple[Rank, int, K]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def rank(self, key: K) -> Rank | None:
        live = self._live.get(key)
        return None if live is None else live[0]

    def set(self, key: K, rank: Rank) -> None:
        live = self._live.get(key)
        if live is not None and live[0] == rank:
            return
        self._seq += 1
        self._live[key] = (rank, self._seq)
        heapq.heappush(self._heap, (rank, self._seq, key))
        self._compact()

    def discard(self, key: K) -> None:
        if self._live.pop(key, None) is not None:
            self._compact()

    def peek(self) -> tuple[K, Rank] | None:
        heap, live = self._heap, self._live
        while heap:
            rank, seq, key = heap[0]
            current = live.get(key)
            if current is not None and current[1] == seq:
                return key, rank
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._live) + _COMPACT_MIN:
            self._heap = [(rank, seq, key) for key, (rank, seq) in self._live.items()]
            heapq.heapify(self._heap)
