"""Requests in flight per engine: the data plane's own count, read by the control plane.

Only the data plane writes it (a proxied stream enters and leaves exactly once); placement
and drain settling read it. DESIGN §9: with several workers this becomes one row per worker,
each written by its owner, and readers sum the rows (`process/table.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class InFlightCounts(Protocol):
    """What placement and drain settling read, and the data plane writes."""

    def enter(self, engine_id: str) -> None: ...

    def leave(self, engine_id: str) -> None: ...

    def of(self, engine_id: str) -> int: ...


class InFlight:
    def __init__(self, engine_ids: Iterable[str]) -> None:
        self._counts = dict.fromkeys(engine_ids, 0)

    def enter(self, engine_id: str) -> None:
        self._counts[engine_id] += 1

    def leave(self, engine_id: str) -> None:
        self._counts[engine_id] -= 1

    def of(self, engine_id: str) -> int:
        return self._counts[engine_id]
