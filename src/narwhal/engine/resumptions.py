"""Restarts seen from outside: an engine that went silent on `/health` and then answered again.

For engines whose process generation cannot be read (no `process_start_time_seconds`), this
is the only sign of a new process; planned maintenance on such an engine ends on it. Only a
silence the router observed counts: a restart faster than one health check goes unnoticed
(documented limit, the same as llama.cpp's generation).
"""

from __future__ import annotations

from dataclasses import dataclass

from narwhal.clock import Clock


@dataclass(frozen=True, slots=True)
class Resumption:
    """The engine was silent from `silent_wall` and answered again at `answered_wall`."""

    silent_wall: float
    answered_wall: float


class Resumptions:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._silent_since: dict[str, float] = {}
        self._last: dict[str, Resumption] = {}

    def observe(self, engine_id: str, answered: bool) -> None:
        """One health answer (True) or silence (False)."""
        now = self._clock.wall()
        if not answered:
            self._silent_since.setdefault(engine_id, now)
            return
        silent = self._silent_since.pop(engine_id, None)
        if silent is not None:
            self._last[engine_id] = Resumption(silent, now)

    def last(self, engine_id: str) -> Resumption | None:
        """The latest silence-then-answer, or None if none was observed."""
        return self._last.get(engine_id)


def restarted_since(resumption: Resumption | None, since_wall: float) -> bool:
    """Whether the engine went silent at or after `since_wall` and has answered since."""
    return resumption is not None and resumption.silent_wall >= since_wall
