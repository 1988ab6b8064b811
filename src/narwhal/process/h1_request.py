"""One request of the HTTP/1.1 server as its handler sees it: the head, the body as it
arrives, and the answer, whole or streamed. It is the data plane's `Exchange`
(`dataplane/exchange.py`).

Why a module of its own: what a handler can do with a request is separate from how the
connection parses and times it (`h1_connection.ServerConnection`, around `h1_state`). A request
talks to its connection only through `RequestConnection`, so its unit tests drive it with a
fake connection (tests/unit/test_h1_request.py). The body is an `h1_body.BodyBuffer`, the
engine client's buffer, with the same back-pressure: past its high water the connection stops
reading until the handler takes the bytes.

This is the hot path of every request: nothing here wraps a call that could be made directly
(the body's reads after the first are the buffer's own method).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Protocol

from narwhal.dataplane.exchange import SSE_HEADERS, Answer, BodyRefused
from narwhal.dataplane.record import RequestRecord
from narwhal.h1_body import BodyBuffer
from narwhal.process.h1_state import Refusal


class RequestConnection(Protocol):
    """What a request needs of its connection (`h1_connection.ServerConnection`)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def date(self) -> Callable[[], bytes]:
        """The `Date` header's value now."""
        ...

    def write(self, data: bytes) -> None:
        """Write without waiting (dropped once the client has gone)."""
        ...

    async def send(self, data: bytes) -> None:
        """Write, then wait while the client's socket is full; `ConnectionResetError` once
        the client has gone."""
        ...

    def pause_body(self) -> None:
        """Stop reading: the body's buffer is full."""
        ...

    def resume_body(self) -> None:
        """Read again: the handler took the buffered body."""
        ...

    def want_body(self, request: ServerRequest) -> None:
        """The handler starts reading the body (a `100 Continue` now, if the client waits
        for one)."""
        ...

    def keeps_open(self) -> bool:
        """Whether the connection may stay open after an answer: not while draining, nor
        once it is closing."""
        ...

    def streaming(self) -> None:
        """A stream's head is going out."""
        ...

    def abort(self) -> None:
        """Drop the connection at once."""
        ...


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


class ServerRequest:
    """One request: its head, its body as it arrives, and its answer (an `Exchange`)."""

    def __init__(self, connection: RequestConnection, method: str, path: str, query: str) -> None:
        self._connection = connection
        self.method = method
        self.path = path
        self.query = query
        self.headers: dict[str, str] = {}  # lower-case names
        self.content_length: int | None = None
        self.keep_alive = True
        self.settled_outcome: str | None = None
        self.record: RequestRecord | None = None
        # Fed by the connection's parser: `feed`, `finish`; `fail` when the client left.
        self.body = BodyBuffer(connection.loop, connection.pause_body, connection.resume_body)
        self.refusal: Refusal | None = None  # the server will not take this body
        self.answered = False  # a head went out
        self.finished = False  # the whole answer went out
        self._chunked = False

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    @property
    def path_qs(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path

    @property
    def body_complete(self) -> bool:
        """The whole body has arrived."""
        return self.body.complete

    # ------------------------------------------------------------------ body
    def refuse(self, refusal: Refusal) -> None:
        """The body will not be taken: what was buffered goes, every read raises."""
        self.refusal = refusal
        self.body.drop(BodyRefused(refusal.status, refusal.message))

    async def read_some(self) -> bytes:
        """The next piece of the body; b"" at its end. Raises `BodyRefused` (413, 408) when
        the server refused it, and `ConnectionResetError` when the client left.

        The first read says the handler wants the body; the later ones are the buffer's own
        `read_some` (set on the instance here), so a body read in many pieces costs no call
        more than the buffer's."""
        body = self.body
        self.read_some = body.read_some  # type: ignore[method-assign]
        self._connection.want_body(self)
        return await body.read_some()

    async def read(self) -> bytes:
        parts = []
        while piece := await self.read_some():
            parts.append(piece)
        return b"".join(parts)

    # ------------------------------------------------------------------ answer
    def respond(
        self,
        status: int,
        body: bytes,
        content_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """The whole answer at once."""
        assert not self.answered, "answered twice"
        self.answered = self.finished = True
        extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        head = self._head(status, content_type.encode("latin-1"), extra)
        length = b"Content-Length: %d\r\n\r\n" % len(body)
        self._connection.write(head + length + (b"" if self.method == "HEAD" else body))

    def answer(self, result: Answer) -> None:
        self.respond(result.status, result.body, result.content_type, result.headers)

    def _head(self, status: int, content_type: bytes, extra: bytes) -> bytes:
        # The connection stays open after this answer (said in the head) only after a whole
        # body that was not refused (a clean boundary), and while the connection may.
        keep = (
            self.keep_alive
            and self.body.complete
            and self.refusal is None
            and self._connection.keeps_open()
        )
        return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nDate: %s\r\n%s%s" % (
            status,
            _reason(status),
            content_type,
            self._connection.date(),
            b"" if keep else b"Connection: close\r\n",
            extra,
        )

    async def start_stream(
        self, headers: Mapping[str, str], content_type: str = SSE_HEADERS["Content-Type"]
    ) -> None:
        """A 200 answer sent piece by piece (chunked): SSE, or `content_type`."""
        assert not self.answered, "answered twice"
        self.answered = True
        self._chunked = True
        self._connection.streaming()
        extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
        head = self._head(200, content_type.encode(), b"Cache-Control: no-cache\r\n" + extra)
        await self._connection.send(head + b"Transfer-Encoding: chunked\r\n\r\n")

    async def send(self, data: bytes) -> None:
        assert self._chunked, "start_stream() first"
        if data:
            await self._connection.send(b"%x\r\n%s\r\n" % (len(data), data))

    async def end(self) -> None:
        assert self._chunked, "start_stream() first"
        if not self.finished:
            self.finished = True
            await self._connection.send(b"0\r\n\r\n")

    def cut_off(self) -> None:
        self._connection.abort()
