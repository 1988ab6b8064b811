"""A worker's evidence sink: leg outcomes go to the control process as events.

The control process's reducer applies them and pushes the changed engines back to every
worker. A success is sent only when this worker's replica shows evidence to clear (the hot
path sends nothing). Before a request's answer is complete, `settled()` waits (briefly) until
the control process acknowledged what was sent: by then the snapshot that pauses the engine
(or clears its evidence) is already in every worker's socket, so the client's next request,
through any worker, sees it.
"""

from __future__ import annotations

import asyncio
import contextlib

from narwhal.engine.failures import EngineFailure, SuccessKind
from narwhal.fleet.store import Fleet
from narwhal.process.channel import Channel
from narwhal.process.events import LegFailed, LegSucceeded


class Reporter:
    def __init__(self, channel: Channel, fleet: Fleet, settle_s: float) -> None:
        """`settle_s`: the longest wait for an acknowledgement, the control process's window
        (a control process quiet for longer is lost, and admission closes anyway)."""
        self._settle_s = settle_s
        self._channel = channel
        self._fleet = fleet
        self._seq = 0
        self._acked = 0
        self._last_sent = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def failure(self, engine_id: str, failure: EngineFailure, leg: str) -> None:
        self._seq += 1
        self._last_sent = self._seq
        self._channel.send_event(LegFailed.of(self._seq, engine_id, leg, failure))

    def success(self, engine_id: str, kind: SuccessKind, leg: str) -> None:
        engine = self._fleet.find(engine_id)
        if engine is None or not engine.evidence:
            return
        self._seq += 1
        self._last_sent = self._seq
        self._channel.send_event(LegSucceeded(self._seq, engine_id, leg, kind))

    def acked(self, upto: int) -> None:
        self._acked = max(self._acked, upto)
        still = []
        for seq, fut in self._waiters:
            if seq <= self._acked:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((seq, fut))
        self._waiters = still

    async def settled(self) -> None:
        """Return once every outcome sent so far was applied (at most `settle_s`)."""
        target = self._last_sent
        if target <= self._acked or self._channel.closed:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._settle_s):
                await fut
