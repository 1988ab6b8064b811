"""Background work per engine: at most one task of each kind per engine.

Suspect probes, inference probes and readmission attempts all start here, through one
`spawn` that the router points at the leadership scope, so fencing cancels every one of them
(DESIGN §8.7). A task that raises is logged, never allowed to take the scope down; a task's
slot is freed when it ends however it ends, cancelled before its first step included.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("narwhal.engine_tasks")

Work = Coroutine[Any, Any, None]
Spawn = Callable[[Work], "asyncio.Task[None] | None"]
"""Start the coroutine as a task, or close it unstarted and return None (not leading)."""


class EngineTasks:
    def __init__(self, spawn: Spawn) -> None:
        self._spawn = spawn
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}

    def busy(self, kind: str, engine_id: str) -> bool:
        return (kind, engine_id) in self._running

    def start(self, kind: str, engine_id: str, work: Work) -> bool:
        """Start `work` unless a task of `kind` already runs for the engine (or the router
        is not leading); `work` is closed unstarted when it is not started."""
        key = (kind, engine_id)
        if key in self._running:
            work.close()
            return False
        task = self._spawn(self._guarded(key, work))
        if task is None:
            work.close()
            return False
        self._running[key] = task

        def ended(task: asyncio.Task[None]) -> None:
            if self._running.get(key) is task:
                del self._running[key]
            work.close()  # a no-op once it ran; a task cancelled before its first step never did

        task.add_done_callback(ended)
        return True

    def cancel(self, engine_id: str) -> None:
        """Stop every task about an engine that left the fleet."""
        for (_, engine), task in list(self._running.items()):
            if engine == engine_id:
                task.cancel()

    @staticmethod
    async def _guarded(key: tuple[str, str], work: Work) -> None:
        try:
            await work
        except Exception:  # a bug in one probe must not cancel its siblings
            log.exception("engine %s: %s task failed", key[1], key[0])
