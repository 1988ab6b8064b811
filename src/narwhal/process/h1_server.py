"""A worker's HTTP/1.1 server on asyncio protocols, parsed by httptools (llhttp).

Why: with the engine legs on protocols (`engine/h1.py`), aiohttp's server was the largest
piece of a request's CPU left that Narwhal can remove (docs/design/raw-server.md). It serves
what a data-plane worker answers, and no more: exact paths, each with its methods, and a
fallback (the worker forwards it to the control process). Requests on one connection are
served one at a time, in order (pipelining allowed); a request's handler starts when its head
is in, and reads its body as it arrives.

What an HTTP server owes its clients, and aiohttp gave: heads over 64 KiB are refused (431),
a malformed request gets 400, both in the OpenAI error shape on `/v1/*` and `/admin/*`, and
the connection is closed; `Expect: 100-continue` is answered when the handler starts; an
idle keep-alive connection (or one whose head does not complete) is closed after
`KEEPALIVE_S`; a client that disconnects cancels its running handler (aiohttp's
`handler_cancellation`); a stream waits for the client to take what was written
(`pause_writing`), and a body the handler leaves unread makes the connection close after the
answer. `drain()` stops accepting, closes idle connections, lets running handlers finish
within a grace, then aborts the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from ssl import SSLContext
from typing import cast

import httptools

from narwhal.dataplane.errors import error_body
from narwhal.dataplane.exchange import SSE_HEADERS, Answer
from narwhal.dataplane.record import RequestRecord

log = logging.getLogger("narwhal.worker.http")

KEEPALIVE_S = 75.0  # aiohttp's default keepalive_timeout
# After an answer given before its request's body had all arrived (a 413, say), the rest of
# the body is read and dropped for up to this long before the connection closes, so the
# client can finish sending and read the answer (aiohttp's lingering_time).
LINGER_S = 10.0
# Connections the kernel queues before this worker accepts them (capped by somaxconn): with
# asyncio's default of 100, a burst of 256 new clients overflowed it and the dropped SYNs were
# retried a second later (measured: p99 1.1 s in the router-bound bench at c=256).
BACKLOG = 1024
MAX_HEAD_BYTES = 64 * 1024
_BODY_HIGH_WATER = 256 * 1024  # request body bytes buffered before reading pauses
_MAX_QUEUED = 16  # pipelined requests waiting before reading pauses
_JSON_PREFIXES = ("/v1/", "/admin/")

Handler = Callable[["ServerRequest"], Awaitable[None]]


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


class _Date:
    """The `Date` header, formatted once a second."""

    def __init__(self) -> None:
        self._second = 0
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


class ServerRequest:
    """One request: its head, its body as it arrives, and its answer (an `Exchange`)."""

    def __init__(self, connection: ServerConnection, method: str, path: str, query: str) -> None:
        self._connection = connection
        self.method = method
        self.path = path
        self.query = query
        self.headers: dict[str, str] = {}  # lower-case names
        self.content_length: int | None = None
        self.keep_alive = True
        self.settled_outcome: str | None = None
        self.record: RequestRecord | None = None
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self.body_complete = False
        self._waiter: asyncio.Future[None] | None = None
        self.answered = False  # a head went out
        self.finished = False  # the whole answer went out
        self.discarding = False
        self._chunked = False

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    @property
    def path_qs(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path

    # ------------------------------------------------------------------ body
    def _feed(self, body: bytes) -> None:
        if self.discarding:
            return
        self._pieces.append(body)
        self._buffered += len(body)
        if self._buffered > _BODY_HIGH_WATER:
            self._connection.pause_reading("body")
        self._wake()

    def _complete(self) -> None:
        self.body_complete = True
        if self.discarding:
            self._connection.close()  # the answer said `Connection: close`
        self._wake()

    def discard_rest(self) -> None:
        """Drop what is left of the body as it arrives (the answer is out)."""
        self.discarding = True
        self._pieces.clear()
        self._buffered = 0

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read_some(self) -> bytes:
        while not self._pieces:
            if self.body_complete:
                return b""
            if self._connection.lost:
                raise ConnectionResetError("the client disconnected")
            self._waiter = self._connection.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces = self._pieces
        data = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        self._connection.resume_reading("body")
        return data

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
        connection = b"" if self._keep() else b"Connection: close\r\n"
        return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nDate: %s\r\n%s%s" % (
            status,
            _reason(status),
            content_type,
            self._connection.date(),
            connection,
            extra,
        )

    def _keep(self) -> bool:
        """Whether the connection stays open after this answer (said in the head): not while
        draining, nor after a body that has not all arrived (no clean boundary)."""
        return self.keep_alive and self.body_complete and not self._connection.server.draining

    async def start_stream(
        self, headers: Mapping[str, str], content_type: str = SSE_HEADERS["Content-Type"]
    ) -> None:
        """A 200 answer sent piece by piece (chunked): SSE, or `content_type`."""
        assert not self.answered, "answered twice"
        self.answered = True
        self._chunked = True
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


class ServerConnection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: H1Server) -> None:
        self.server = server
        self.loop = server.loop
        self.date = server.date
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._url = b""
        self._head_bytes = 0  # the current head's, counted as the parser hands it over
        self._head_raw = 0  # bytes received while a head is incomplete
        self._reading_head = True
        self._parsing: ServerRequest | None = None
        self._queue: deque[ServerRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._paused_by: set[str] = set()
        self._idle: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        self.server.settled()
        self._disarm_idle()
        if self._linger is not None:
            self._linger.cancel()
        for request in (self._parsing, *self._queue):
            if request is not None:
                request._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the client disconnected"))
            self._writable.exception()  # retrieved: the writer may already be gone
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: stop serving it

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # refused or closing: nothing more is parsed
        if self._reading_head:
            self._head_raw += len(data)
        try:
            self._parser.feed_data(data)
            if self._reading_head and self._head_raw > MAX_HEAD_BYTES:
                # httptools hands a header over only once its line ends: a head that keeps
                # growing without one is refused here.
                self._refuse(431, "request head too large")
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            too_big = isinstance(exc.__context__, _HeadTooLarge)
            if too_big:
                self._refuse(431, "request head too large")
            else:
                self._refuse(400, f"malformed HTTP request: {exc}")

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        if self._parsing is None:
            self._parsing = self._new_request()
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = self._parsing.headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_raw = 0
        request = self._parsing or self._new_request()
        self._parsing = request
        request.keep_alive = self._parser.should_keep_alive()
        length = request.headers.get("content-length")
        request.content_length = int(length) if length and length.isdigit() else None
        self._queue.append(request)
        if len(self._queue) > _MAX_QUEUED:
            self.pause_reading("queue")
        self._disarm_idle()
        self._next()

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing._feed(body)

    def on_message_complete(self) -> None:
        if self._parsing is not None:
            self._parsing._complete()
        self._parsing = None
        self._reading_head = True

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge()

    def _new_request(self) -> ServerRequest:
        parsed = httptools.parse_url(self._url)
        path = (parsed.path or b"/").decode("latin-1")
        query = (parsed.query or b"").decode("latin-1")
        return ServerRequest(self, self._parser.get_method().decode("latin-1"), path, query)

    # ------------------------------------------------------------------ serving
    def _next(self) -> None:
        """Start the next queued request's handler, if none is running."""
        if self._task is not None or not self._queue or self.lost:
            return
        request = self._queue[0]
        if request.headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: ServerRequest) -> None:
        try:
            await self.server.dispatch(request)
            if not request.answered and not self.lost:
                self._error(request, 500, "internal server error: no answer")
        except asyncio.CancelledError:
            return  # the client left (connection_lost), or the drain's grace ran out
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.path)
            if not request.answered:
                self._error(request, 500, "internal server error")
            else:
                self.abort()
                return
        finally:
            self._task = None
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
            self.resume_reading("queue")
        self.resume_reading("body")  # a body left unread no longer holds the connection
        if request.finished and not request.body_complete and not self.lost:
            # Answered before the body was in: let the client finish sending and read the
            # answer, then close (the head said so).
            request.discard_rest()
            self._linger = self.loop.call_later(self.server.linger_s, self.close)
            return
        if not request.finished or not request._keep():
            self.close()  # a stream cut short, or the head said `Connection: close`
            return
        if self._queue:
            self._next()
        elif self.server.draining:
            self.close()
        else:
            self._arm_idle()

    def _error(self, request: ServerRequest, status: int, message: str) -> None:
        if request.path.startswith(_JSON_PREFIXES):
            kind = "invalid_request_error" if status < 500 else "server_error"
            request.respond(status, error_body(message, kind, status), "application/json")
        else:
            request.respond(status, message.encode(), "text/plain")

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be parsed, then close."""
        request = ServerRequest(self, "GET", "/", "")
        try:
            path = httptools.parse_url(self._url).path or b"/"
            request.path = path.decode("latin-1")
        except httptools.HttpParserInvalidURLError:
            pass
        request.keep_alive = False
        if self._task is None:
            self._error(request, status, message)
        self.close()

    # ------------------------------------------------------------------ transport
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.lost and not self.transport.is_closing():
            self.transport.write(data)

    async def send(self, data: bytes) -> None:
        """Write, then wait while the client's socket is full."""
        if self.lost:
            raise ConnectionResetError("the client disconnected")
        assert self.transport is not None
        self.transport.write(data)
        writable = self._writable
        if writable is not None and not writable.done():
            await asyncio.shield(writable)

    def pause_reading(self, why: str) -> None:
        if not self._paused_by and self.transport is not None and not self.lost:
            self.transport.pause_reading()
        self._paused_by.add(why)

    def resume_reading(self, why: str) -> None:
        if why in self._paused_by:
            self._paused_by.discard(why)
            if not self._paused_by and self.transport is not None and not self.lost:
                self.transport.resume_reading()

    def close(self) -> None:
        """Close once what was written has been sent."""
        if self.transport is not None and not self.lost:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.abort()

    def _arm_idle(self) -> None:
        self._disarm_idle()
        self._idle = self.loop.call_later(self.server.keepalive_s, self.close)

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None


class _HeadTooLarge(Exception):
    """Raised inside a parser callback; httptools reports it as a callback error."""


class H1Server:
    """Routes by exact path; `fallback` answers every other path."""

    def __init__(
        self,
        routes: Mapping[str, Mapping[str, Handler]],
        fallback: Handler,
        keepalive_s: float = KEEPALIVE_S,
        linger_s: float = LINGER_S,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._routes = routes
        self._fallback = fallback
        self.keepalive_s = keepalive_s
        self.linger_s = linger_s
        self.connections: set[ServerConnection] = set()
        self.draining = False
        self.date = _Date()
        self._server: asyncio.Server | None = None
        self._drained: asyncio.Event | None = None

    @property
    def port(self) -> int:
        """The bound port (after `start`)."""
        assert self._server is not None, "start() first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def settled(self) -> None:
        """A connection finished a request or closed: while draining, maybe the last one.
        Draining is over when every connection has closed, which a connection does after
        its last answer has gone out (`transport.close` sends what is buffered first)."""
        if self._drained is not None and not self.connections:
            self._drained.set()

    async def dispatch(self, request: ServerRequest) -> None:
        methods = self._routes.get(request.path)
        if methods is None:
            await self._fallback(request)
            return
        handler = methods.get(request.method) or (
            methods.get("GET") if request.method == "HEAD" else None
        )
        if handler is None:
            allow = ", ".join(sorted({*methods, *(["HEAD"] if "GET" in methods else [])}))
            message = f"Method Not Allowed: {request.method} {request.path}"
            request.respond(
                405,
                error_body(message, "invalid_request_error", 405),
                "application/json",
                {"Allow": allow},
            )
            return
        await handler(request)

    async def start(self, host: str, port: int, ssl: SSLContext | None = None) -> None:
        """Listen (HTTPS with `ssl`: the handshake is asyncio's, before any request)."""
        self._server = await self.loop.create_server(
            lambda: ServerConnection(self),
            host,
            port,
            reuse_address=True,
            reuse_port=True,
            backlog=BACKLOG,
            ssl=ssl,
        )

    async def drain(self, grace_s: float) -> None:
        """Stop accepting; close idle connections at once and the others after their
        running request; past `grace_s`, abort what is left."""
        self.draining = True
        self._drained = asyncio.Event()
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            if c._task is None:
                c.close()
        self.settled()
        try:
            async with asyncio.timeout(grace_s):
                await self._drained.wait()
        except TimeoutError:
            pass
        for c in list(self.connections):
            c.abort()
