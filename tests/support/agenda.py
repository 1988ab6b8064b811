"""An agenda of timed events for the virtual-time scenarios: pushed in any order, popped by
time, ties in the order pushed. `count` numbers every push (request ids use it)."""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

T = TypeVar("T")


class Agenda(Generic[T]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, T]] = []
        self.count = 0

    def push(self, at: float, kind: str, what: T) -> None:
        self.count += 1
        heapq.heappush(self._heap, (at, self.count, kind, what))

    def pop(self) -> tuple[float, str, T] | None:
        """The next event (time, kind, what), or None when none is left."""
        if not self._heap:
            return None
        at, _, kind, what = heapq.heappop(self._heap)
        return at, kind, what
