"""The event timeline (`GET /admin/events`, `narwhal events`, issue 20 §4): what happened to
the fleet and the router, newest last, each with its reason.

Kept in the control process, in memory, the last `capacity` events: engine transitions
(ejections, holds and their release, readmissions, verification), membership changes, reloads,
lease changes, and stream migrations (reported by the data plane, in whichever process). Each
event has a sequence number, so a follower asks for what came after the last one it saw.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from narwhal.clock import Clock

Note = Callable[[str, "str | None", str], None]
"""Puts an event on the timeline (`EventLog.add`, or a worker's frame to it): kind, engine
id or None, what happened."""


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    at: float  # wall clock
    kind: str  # transition, membership, reload, lease, migration
    engine: str | None
    what: str

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "at": self.at, "kind": self.kind, "engine": self.engine,
                "what": self.what}  # fmt: skip


class EventLog:
    def __init__(self, clock: Clock, capacity: int = 1000) -> None:
        self._clock = clock
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = itertools.count(1)

    def add(self, kind: str, engine: str | None, what: str) -> None:
        self._events.append(Event(next(self._seq), self._clock.wall(), kind, engine, what))

    def after(self, seq: int) -> list[Event]:
        """The events newer than `seq`, oldest first."""
        return [e for e in self._events if e.seq > seq]
