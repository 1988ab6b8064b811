"""Injected time: every decision takes `now` from a Clock, never from the OS directly.

`monotonic()` measures intervals (deadlines, lease expiry); `wall()` stamps documents
(handoff `written_at`, hold deadlines that must survive a restart).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock that only moves when a test says so."""

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_800_000_000.0) -> None:
        self._mono = monotonic
        self._wall = wall

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never goes back")
        self._mono += seconds
        self._wall += seconds
