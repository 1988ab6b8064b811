"""Virtual token counters (Sheng et al., "Fairness in Serving Large Language Models", OSDI
2024): the service each client got, in tokens divided by its weight.

The least-served backlogged client starts next (`queue.py`). A client that becomes backlogged
(its first waiting request) is lifted to the least counter among the backlogged clients, or,
with none, to the counter of the client that left the backlog last: a client that was idle
banks no credit to crowd the others out later. Two equal-weight clients backlogged together
are then served within about two requests' tokens of each other, whatever they send.
"""

from __future__ import annotations

from collections.abc import Callable

from narwhal.flow.heap import KeyedHeap


def uniform(_client: str) -> float:
    """Every client's weight is 1."""
    return 1.0


class VirtualCounters:
    """Counters per client, weighed by `weight(client)` (> 0) when charged. The backlog is
    what the queue says it is (`join`, `leave`)."""

    def __init__(self, weight: Callable[[str], float] = uniform) -> None:
        self.weight = weight  # replaced on reload: later charges use the new weights
        self._values: dict[str, float] = {}
        self._backlog: KeyedHeap[str] = KeyedHeap()
        self._last_left: str | None = None

    def __len__(self) -> int:
        return len(self._values)

    def value(self, client: str) -> float:
        return self._values.get(client, 0.0)

    def backlogged(self, client: str) -> bool:
        return client in self._backlog

    def floor(self) -> float | None:
        """What a client joining the backlog now is lifted to, at least."""
        top = self._backlog.peek()
        if top is not None:
            return top[1][0]
        if self._last_left is not None:
            return self.value(self._last_left)
        return None

    def lifted(self, client: str) -> float:
        """The counter `client` has once it joins the backlog now (its own if it is in)."""
        value = self.value(client)
        if client in self._backlog:
            return value
        floor = self.floor()
        return value if floor is None else max(value, floor)

    def charge(self, client: str, tokens: float) -> float:
        """Count `tokens` served to `client` (prompt tokens at its start, output tokens as
        they are delivered); the new counter."""
        value = self._values[client] = self.value(client) + tokens / self.weight(client)
        if client in self._backlog:
            self._backlog.set(client, (value,))
        return value

    def join(self, client: str) -> float:
        """`client` has its first waiting request: lifted, and in the backlog."""
        value = self._values[client] = self.lifted(client)
        self._backlog.set(client, (value,))
        return value

    def leave(self, client: str) -> None:
        """`client` has no waiting request left."""
        if client in self._backlog:
            self._backlog.discard(client)
            self._last_left = client

    def prune(self) -> int:
        """Forget idle clients whose counter is at or below the floor (joining again would
        lift them to it anyway), so clients that come and go do not pile up. Returns how
        many were forgotten."""
        floor = self.floor()
        if floor is None:
            return 0
        gone = [
            c
            for c, v in self._values.items()
            if v <= floor and c not in self._backlog and c != self._last_left
        ]
        for client in gone:
            del self._values[client]
        return len(gone)
