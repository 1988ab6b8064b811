"""Streams that planned maintenance may move off their decode engine, asked for explicitly.

A stream that may migrate registers its task while it reads its engine; `move(engine_id)`
marks each of that engine's streams moved and cancels its task (with `MOVE` as the message,
for whoever reads a traceback). The streaming leg catches that one cancellation (`is_move`),
takes it back (`uncancel`) and continues the stream elsewhere with nothing charged to the
engine. Any other cancellation (the client left, the router stops) passes through untouched.
"""

from __future__ import annotations

import asyncio
import logging

from narwhal.dataplane.leg import Attempt

log = logging.getLogger("narwhal.proxy")

MOVE = "narwhal: moved off for planned maintenance"


class Moves:
    def __init__(self) -> None:
        self._by_engine: dict[str, dict[Attempt, asyncio.Task[object]]] = {}

    def register(self, engine_id: str, attempt: Attempt) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._by_engine.setdefault(engine_id, {})[attempt] = task

    def unregister(self, engine_id: str, attempt: Attempt) -> None:
        streams = self._by_engine[engine_id]
        del streams[attempt]
        if not streams:
            del self._by_engine[engine_id]

    def move(self, engine_id: str) -> int:
        """Move every registered stream off `engine_id`; how many."""
        streams = self._by_engine.get(engine_id, {})
        for attempt, task in streams.items():
            if not attempt.moved:
                attempt.moved = True
                task.cancel(MOVE)
        if streams:
            log.info("moving %d streams off %s (planned maintenance)", len(streams), engine_id)
        return len(streams)


def is_move(attempt: Attempt) -> bool:
    """Whether the cancellation being handled is the move asked for this attempt, and only
    it: no other cancellation is pending (a client that left at the same moment wins). A
    stream timer that expired at the same moment has taken its own back already."""
    task = asyncio.current_task()
    return attempt.moved and task is not None and task.cancelling() == 1
