"""A stream's read deadlines on one lazily re-armed timer.

Until the first byte reaches the client, the engine has until the first-token deadline; after
that, each read may wait `idle_s` of silence, never past the request's deadline. Time spent
writing to the client is not the engine's silence. Rescheduling an `asyncio.timeout` around
every read costs two timer operations per chunk (cancel, then a new heap entry); here a chunk
costs two attribute stores, and the one timer, when it fires before the current read's
deadline, re-arms itself at that deadline.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


def read_deadline(
    reading_since: float | None,
    started: bool,
    first_deadline: float,
    request_deadline: float,
    idle_s: float,
) -> float | None:
    """When the current read times out; None while no read is waiting."""
    if reading_since is None:
        return None
    if not started:
        return first_deadline
    return min(reading_since + idle_s, request_deadline)


class _Timeout(Protocol):
    def reschedule(self, when: float | None) -> None: ...


class ReadWatchdog:
    """Expires `timeout` (an `asyncio.timeout_at(None)` around the stream) when a read is late."""

    __slots__ = (
        "_first",
        "_handle",
        "_idle_s",
        "_loop",
        "_request",
        "_since",
        "_started",
        "_timeout",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout: _Timeout,
        first_deadline: float,
        request_deadline: float,
        idle_s: float,
    ) -> None:
        self._loop = loop
        self._timeout = timeout
        self._first = first_deadline
        self._request = request_deadline
        self._idle_s = idle_s
        self._since: float | None = None
        self._started = False
        self._handle = loop.call_at(first_deadline, self._check)

    def started(self) -> None:
        """A byte reached the client: idle deadlines from now on. The timer, armed for the
        first-token deadline, moves to the first idle deadline (the earliest one possible)."""
        self._started = True
        self._handle.cancel()
        self._handle = self._loop.call_at(self._loop.time() + self._idle_s, self._check)

    def reading(self) -> None:
        """A read from the engine starts now."""
        self._since = self._loop.time()

    def writing(self) -> None:
        """The read returned; what follows is the client's time, not the engine's."""
        self._since = None

    def close(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        due = read_deadline(self._since, self._started, self._first, self._request, self._idle_s)
        if due is not None and due <= now:
            self._timeout.reschedule(now)  # expire: the awaiting read is cancelled
            return
        # Every later read starts at `now` or after, so its deadline is no earlier than this.
        self._handle = self._loop.call_at(now + self._idle_s if due is None else due, self._check)
