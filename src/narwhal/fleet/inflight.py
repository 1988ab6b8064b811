"""Requests in flight per engine: the data plane's own count, read by the control plane.

Only the data plane writes it (a placed leg is claimed once and left exactly once); placement
and drain settling read it. DESIGN §9: with several workers this becomes one row per worker,
each written by its owner, and readers sum the rows (`process/table.py`).

Placement's rotation lives here too: with several workers, picking an engine and counting the
pick must be one step for all of them, or two concurrent requests in two workers read the
same counts and the same turn and land on the same engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

Choose = Callable[[int], "str | None"]
"""Placement over the current counts: given the role's turn, an engine id or None."""


class InFlightCounts(Protocol):
    """What placement and drain settling read, and the data plane writes."""

    def claim(self, role: str, choose: Choose) -> str | None:
        """Take the role's next turn, run `choose` on it and enter its pick, as one step."""
        ...

    def enter(self, engine_id: str) -> None: ...

    def leave(self, engine_id: str) -> None: ...

    def of(self, engine_id: str) -> int: ...

    def add(self, engine_id: str) -> None:
        """A new member: counted from zero."""
        ...

    def remove(self, engine_id: str) -> None:
        """A member left: legs still on it leave without a trace (`leave` ignores it)."""
        ...


class InFlight:
    def __init__(self, engine_ids: Iterable[str]) -> None:
        self._counts = dict.fromkeys(engine_ids, 0)
        self._turns: dict[str, int] = {}

    def claim(self, role: str, choose: Choose) -> str | None:
        turn = self._turns[role] = self._turns.get(role, -1) + 1
        engine_id = choose(turn)
        if engine_id is not None:
            self._counts[engine_id] += 1
        return engine_id

    def enter(self, engine_id: str) -> None:
        self._counts[engine_id] += 1

    def leave(self, engine_id: str) -> None:
        if engine_id in self._counts:
            self._counts[engine_id] -= 1

    def of(self, engine_id: str) -> int:
        return self._counts.get(engine_id, 0)

    def add(self, engine_id: str) -> None:
        self._counts[engine_id] = 0

    def remove(self, engine_id: str) -> None:
        self._counts.pop(engine_id, None)
