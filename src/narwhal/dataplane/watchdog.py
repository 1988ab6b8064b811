"""A stream's read deadlines on one lazily re-armed timer.

Until the first byte reaches the client, the engine has until the first-token deadline; after
that, each read may wait `idle_s` of silence, never past the request's deadline. Time spent
writing to the client is not the engine's silence, but it is bounded by the request's deadline:
a client that stops reading must not hold its data connection and the engine's in-flight slot
forever (`writing_expired` then says the client, not the engine, ran out the clock).
Rescheduling an `asyncio.timeout` around every read costs two timer operations per chunk
(cancel, then a new heap entry); here a chunk costs two attribute stores, and the one timer,
when it fires before the current read's deadline, re-arms itself at that deadline.
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
) -> float:
    """When the current read times out; while no read is waiting (the router is writing to
    the client), the request's deadline."""
    if reading_since is None:
        return request_deadline
    if not started:
        return first_deadline
    return min(reading_since + idle_s, request_deadline)


class _Timeout(Protocol):
    def reschedule(self, when: float | None) -> None: ...


class ReadWatchdog:
    """Expires `timeout` (an `asyncio.timeout_at(None)` around the stream) when a read is late,
    or when a write to the client outlasts the request's deadline."""

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

    @property
    def writing_expired(self) -> bool:
        """Whether the timer expired while writing to the client (the client's doing)."""
        return self._since is None

    def close(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        due = read_deadline(self._since, self._started, self._first, self._request, self._idle_s)
        if due <= now:
            self._timeout.reschedule(now)  # expire: the awaiting read or write is cancelled
            return
        if self._since is None:
            # Writing: a read that starts later (at `now` or after) has a deadline no earlier
            # than `now + idle_s`, so wake by then to look again.
            due = min(due, now + self._idle_s)
        self._handle = self._loop.call_at(due, self._check)
