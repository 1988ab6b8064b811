"""One HTTP/1.1 message body as it arrives, read in pieces, with flow control.

Why a module of its own: both sides of the router read bodies this way, the engine client
(`engine/h1.py`, an engine's answer) and the client server (`process/h1_request.py`, a
client's request), so the buffer and its back-pressure exist once. It touches no socket: the
protocol that owns it says how to pause and resume reading.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

HIGH_WATER = 256 * 1024  # body bytes buffered unread before reading pauses


class BodyBuffer:
    """One message's body as it arrives, read in pieces, with flow control: once more than
    `high_water` bytes wait unread, `pause` is called (the protocol stops reading its socket),
    and `resume` once a reader has taken them. The end is `finish`, or `fail` with the error
    readers then get (`drop` also throws away what waits unread). Nothing here touches a
    socket, so any protocol can own one."""

    __slots__ = (
        "_buffered",
        "_error",
        "_high_water",
        "_loop",
        "_pause",
        "_pieces",
        "_resume",
        "_waiter",
        "complete",
        "paused",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pause: Callable[[], None],
        resume: Callable[[], None],
        high_water: int = HIGH_WATER,
    ) -> None:
        self._loop = loop
        self._pause = pause
        self._resume = resume
        self._high_water = high_water
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self.paused = False
        self.complete = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def empty(self) -> bool:
        return not self._pieces

    def feed(self, data: bytes) -> None:
        self._pieces.append(data)
        self._buffered += len(data)
        if self._buffered > self._high_water and not self.paused:
            self.paused = True
            self._pause()
        waiter = self._waiter  # `_wake`, inline: this runs for every piece of every body
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def finish(self) -> None:
        self.complete = True
        waiter = self._waiter  # `_wake`, inline: this runs for every body
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: Exception) -> None:
        """End the body with `error` (the first one wins; nothing once it is complete)."""
        if self._error is None and not self.complete:
            self._error = error
            self._wake()

    def drop(self, error: Exception) -> None:
        """Refuse the body: what waits unread is thrown away and every read from now on
        raises `error`, even after the end (a server that will not take a body hands none
        of it on)."""
        self._error = error
        self._pieces.clear()
        self._buffered = 0
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read_some(self) -> bytes:
        """The bytes that arrived since the last call (waiting for some); b"" at the end."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces = self._pieces
        data = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        if self.paused:
            self.paused = False
            self._resume()
        return data
