"""Streams moved off their decode engine on purpose: by planned maintenance (every stream of
an engine, `move`), or by flow control's preemption (one stream, `preempt`: a more urgent
request needs its slot).

A stream that may migrate registers its task while it reads its engine; a move marks the
attempt with its cause and cancels the task (with the cause's message, for whoever reads a
traceback). The streaming leg catches that one cancellation (`is_move`), takes it back
(`uncancel`) and continues the stream elsewhere with nothing charged to the engine. Any other
cancellation (the client left, the router stops) passes through untouched.
"""

from __future__ import annotations

import asyncio
import logging

from narwhal.dataplane.leg import Attempt

log = logging.getLogger("narwhal.proxy")

MAINTENANCE = "maintenance"
PREEMPTED = "preempted"
_MESSAGES = {
    MAINTENANCE: "narwhal: moved off for planned maintenance",
    PREEMPTED: "narwhal: preempted for a more urgent request",
}


class Moves:
    def __init__(self) -> None:
        self._by_engine: dict[str, dict[Attempt, asyncio.Task[object]]] = {}
        self._by_request: dict[str, tuple[Attempt, asyncio.Task[object]]] = {}

    def register(self, engine_id: str, attempt: Attempt, request: str | None = None) -> None:
        """The current task reads `attempt`'s stream from `engine_id`; `request` is the
        client request's id in flow control (None: not known there)."""
        task = asyncio.current_task()
        assert task is not None
        self._by_engine.setdefault(engine_id, {})[attempt] = task
        if request is not None:
            self._by_request[request] = (attempt, task)

    def unregister(self, engine_id: str, attempt: Attempt, request: str | None = None) -> None:
        streams = self._by_engine[engine_id]
        del streams[attempt]
        if not streams:
            del self._by_engine[engine_id]
        if request is not None:
            self._by_request.pop(request, None)

    def move(self, engine_id: str) -> int:
        """Move every registered stream off `engine_id`; how many."""
        streams = self._by_engine.get(engine_id, {})
        for attempt, task in streams.items():
            _cut(attempt, task, MAINTENANCE)
        if streams:
            log.info("moving %d streams off %s (planned maintenance)", len(streams), engine_id)
        return len(streams)

    def reading(self, request: str) -> Attempt | None:
        """The attempt whose stream `request` is reading now, if any."""
        found = self._by_request.get(request)
        return None if found is None else found[0]

    def preempt(self, request: str) -> bool:
        """Move `request`'s stream off its engine for a more urgent one; whether it was
        reading one."""
        found = self._by_request.get(request)
        if found is None:
            return False
        return _cut(*found, PREEMPTED)


def _cut(attempt: Attempt, task: asyncio.Task[object], cause: str) -> bool:
    """Mark the attempt moved (the first cause stands) and cancel its read."""
    if attempt.moved is not None:
        return False
    attempt.moved = cause
    task.cancel(_MESSAGES[cause])
    return True


def is_move(attempt: Attempt) -> bool:
    """Whether the cancellation being handled is the move asked for this attempt, and only
    it: no other cancellation is pending (a client that left at the same moment wins). A
    stream timer that expired at the same moment has taken its own back already."""
    task = asyncio.current_task()
    return attempt.moved is not None and task is not None and task.cancelling() == 1
