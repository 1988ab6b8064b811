"""One client connection of the worker's HTTP/1.1 server (`h1_server.H1Server`): the I/O
shell around `h1_state.Connection`, the connection's state machine.

It feeds httptools' parser events and the time to the state machine and does what it says
(answer a refusal, pause or resume reading, close), hands each request to the server's
`dispatch` as an `h1_request.ServerRequest`, and serves a connection's requests one at a time,
in order (pipelining allowed). Its one limit of its own: a client whose socket stays full,
taking nothing of what waits for it for `send_timeout_s`, is aborted and counted
`send_timeout`, whatever the state machine says (it is done with a connection closing after
its answer, but that close waits for the answer to be sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import sys
import termios
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

import httptools

from narwhal.dataplane.errors import error_body
from narwhal.dataplane.exchange import BodyRefused
from narwhal.process.h1_request import ServerRequest
from narwhal.process.h1_state import After, Connection, Out, Refusal

if TYPE_CHECKING:
    from narwhal.process.h1_server import H1Server

log = logging.getLogger("narwhal.worker.http")

_MAX_QUEUED = 16  # pipelined requests waiting before reading pauses
_JSON_PREFIXES = ("/v1/", "/admin/")


class ServerConnection(asyncio.Protocol):
    """One client connection: the parser's callbacks and the transport, around `state`."""

    def __init__(self, server: H1Server) -> None:
        self.server = server
        self.loop = server.loop
        self.date = server.date
        self._parser = httptools.HttpRequestParser(self)
        self.state = Connection(server.limits, self.loop.time())
        # `RequestConnection.streaming`: the state machine's own method, no call in between.
        self.streaming: Callable[[], None] = self.state.stream
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._admitted = False
        self._url = b""
        self._parsing: ServerRequest | None = None
        self._in_trailers = False  # the current message's head is done: headers now are trailers
        self._queue: deque[ServerRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._paused_by: set[str] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # while the client's socket is full: the send timeout, and what was left to send
        self._stall: asyncio.TimerHandle | None = None
        self._stall_left = 0

    # ------------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        server = self.server
        if server.draining or not server.budget.take():
            # Past the router's bound: closed before anything is read (a reset, no answer).
            if not server.draining:
                server.on_reject("connections")
            self.state.close()
            self.transport.abort()
            return
        self._admitted = True
        server.connections.add(self)
        self._schedule()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.state.lost()
        if self._admitted:
            self._admitted = False
            self.server.budget.give_back()
        self.server.connections.discard(self)
        self.server.settled()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._unstall()
        for request in (self._parsing, *self._queue):
            if request is not None:
                request.body.fail(ConnectionResetError("the client disconnected"))
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the client disconnected"))
            self._writable.exception()  # retrieved: the writer may already be gone
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: stop serving it

    def data_received(self, data: bytes) -> None:
        transport, state = self.transport, self.state
        if transport is None or transport.is_closing() or state.closed:
            return  # refused or closing: nothing more is read
        now = self.loop.time()
        state.data(len(data), now)
        if state.closing:
            if state.closed:
                self.close()
            elif state.answer_pending:
                self.pause_reading("refused")  # until the refusal's answer is out
            else:
                if state.discard_full:
                    self.pause_reading("discarded")  # for the rest of the linger
                self._schedule()
            return  # dropped, unparsed
        # A refusal while a request's body is being read is that request's: its handler,
        # waiting for the body, is told (and answers), or it would wait forever.
        try:
            self._parser.feed_data(data)
            refusal = state.parsed(now)
            if refusal is not None:
                self._refused(refusal, self._parsing)
        except httptools.HttpParserUpgrade:
            self._refused(
                state.refuse(400, "malformed", "protocol upgrades are not supported", now),
                self._parsing,
            )
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                self._refused(cause.refusal, self._parsing)
            elif not isinstance(cause, _Stop):
                message = f"malformed HTTP request: {exc}"
                self._refused(state.refuse(400, "malformed", message, now), self._parsing)
        self._schedule()

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()
        if self._stall is None and self.transport is not None:
            self._stall_left = _unsent(self.transport)
            self._stall = self.loop.call_later(self.server.limits.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._unstall()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if "write" in self._paused_by:
            self.resume_reading("write")
            self._next()

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._head_bytes = 0
        self._in_trailers = False
        self.state.begin(self.loop.time())

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_trailers:
            # Trailer fields are never merged into the head (RFC 9110 §6.5.1), but they
            # count against its limit as they come: a body's trailers are not raw-counted.
            self._count(len(name) + len(value) + 4)
            return
        # A head's pieces are summed here and judged once it is whole (`on_headers_complete`):
        # one read hands the parser a bounded number of bytes, and a head still incomplete
        # is bounded on its raw size (`Connection.parsed`).
        self._head_bytes += len(name) + len(value) + 4
        if self._parsing is None:
            self._parsing = self._new_request()
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = self._parsing.headers
        if key == "host" and key in headers:
            message = "more than one Host header"
            raise _Refused(self.state.refuse(400, "malformed", message, self.loop.time()))
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        request = self._parsing or self._new_request()
        self._parsing = request
        self._count(self._head_bytes)
        bad = _framing_refusal(request.headers, self._parser.get_http_version())
        if bad is not None:
            raise _Refused(self.state.refuse(400, "malformed", bad, self.loop.time()))
        request.keep_alive = self._parser.should_keep_alive()
        length = request.headers.get("content-length")
        request.content_length = int(length) if length and length.isdigit() else None
        expects = request.headers.get("expect", "").lower() == "100-continue"
        refusal = self.state.head(request.content_length, expects, self.loop.time())
        if refusal is not None:
            raise _Refused(refusal)  # stops the parser: nothing more of it is read
        self._in_trailers = True
        self._queue.append(request)
        if len(self._queue) > _MAX_QUEUED:
            self.pause_reading("queue")
        self._next()

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        refusal = self.state.body(len(body), self.loop.time())
        if request is None:
            return
        if refusal is not None:
            self._refused(refusal, request)
            raise _Stop()
        if not self.state.discarding:
            request.body.feed(body)

    def on_message_complete(self) -> None:
        self._in_trailers = False
        if self._parsing is not None:
            self._parsing.body.finish()
        self._parsing = None
        if not self.state.discarding:
            self.state.end(self.loop.time())

    def _count(self, n: int) -> None:
        refusal = self.state.header(n, self.loop.time())
        if refusal is not None:
            raise _Refused(refusal)

    def _new_request(self) -> ServerRequest:
        parsed = httptools.parse_url(self._url)
        path = (parsed.path or b"/").decode("latin-1")
        query = (parsed.query or b"").decode("latin-1")
        return ServerRequest(self, self._parser.get_method().decode("latin-1"), path, query)

    # ------------------------------------------------------------------ serving
    def _next(self) -> None:
        """Start the next queued request's handler, if none is running. Not while the
        client is not taking its answers (its socket and our buffer are full): a pipelining
        client that never reads would otherwise have every answer buffered here; reading
        stops too until it takes them."""
        if self._task is not None or not self._queue or self.lost:
            return
        if self._writable is not None and not self._writable.done():
            self.pause_reading("write")
            return
        self.state.start()
        self._task = self.loop.create_task(self._serve(self._queue[0]))

    def want_body(self, request: ServerRequest) -> None:
        """The handler reads the body: a `100 Continue` now if the client waits for one."""
        if request is self._parsing and self.state.want_body(self.loop.time()):
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._schedule()

    async def _serve(self, request: ServerRequest) -> None:
        try:
            await self.server.dispatch(request)
            if not request.answered and not self.lost:
                self._error(request, 500, "internal server error: no answer")
        except asyncio.CancelledError:
            return  # the client left (connection_lost), or the drain's grace ran out
        except BodyRefused as exc:  # a handler that did not answer the refusal itself
            if not request.answered:
                body = error_body(exc.message, "invalid_request_error", exc.status)
                request.respond(exc.status, body, "application/json")
            else:
                self.abort()
                return
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
            if len(self._queue) <= _MAX_QUEUED:  # a flood past the bound stays paused
                self.resume_reading("queue")
        self.resume_reading("body")  # a body left unread no longer holds the connection
        self.resume_reading("refused")
        if self.lost:
            return
        if not request.finished:
            self.close()  # a stream cut short
            return
        now = self.loop.time()
        keep = request.keep_alive and not self.server.draining
        after = self.state.answered(request.body.complete, keep, now)
        if after is After.KEEP:
            if self._queue:
                self._next()
            elif self.server.draining:
                self.close()
            self._schedule()
        elif after is After.DISCARD:
            # Answered before the body was in (or refused): let the client finish sending
            # and read the answer, then close (the head said so).
            request.refuse(request.refusal or _DROPPED)
            self._half_close()
            self._schedule()
        else:
            self.close()

    def _error(self, request: ServerRequest, status: int, message: str) -> None:
        if request.path.startswith(_JSON_PREFIXES):
            kind = "invalid_request_error" if status < 500 else "server_error"
            request.respond(status, error_body(message, kind, status), "application/json")
        else:
            request.respond(status, message.encode(), "text/plain")

    def _refused(self, refusal: Refusal, request: ServerRequest | None = None) -> None:
        """A limit or a malformed request: counted; told to the running handler if it is
        this request's (it answers), else answered here when nothing else is being
        answered; then the connection closes."""
        self.server.on_reject(refusal.reason)
        served = self._queue[0] if self._queue and self._task is not None else None
        if request is not None and request is served and not request.answered:
            request.refuse(refusal)  # its next read raises; `_serve` closes after
            return
        if request is not None:
            request.refuse(refusal)
        if self.state.outbound is not Out.CLOSED:
            return  # another request's answer is going out: the close follows it
        answer = ServerRequest(self, "GET", "/", "")
        answer.keep_alive = False
        body = error_body(refusal.message, "invalid_request_error", refusal.status)
        answer.respond(refusal.status, body, "application/json")
        self._half_close()

    def _half_close(self) -> None:
        """Done writing: end our side now (where the transport can) and read what the
        client still sends until the state closes."""
        transport = self.transport
        if transport is None or self.lost or transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        else:
            self.close()  # TLS: no half-close

    # ------------------------------------------------------------------ time
    def _schedule(self) -> None:
        """One timer per connection, moved only earlier: when it fires later than needed
        it is set again (the body's clock moves at every read)."""
        state = self.state
        if state.closed:
            self.close()
            return
        deadline = state.deadline()
        if deadline is None:
            return
        timer = self._timer
        if timer is not None:
            if self._timer_at <= deadline:
                return
            timer.cancel()
        self._timer_at = deadline
        self._timer = self.loop.call_at(deadline, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.lost:
            return
        refusal = self.state.expire(self.loop.time())
        if refusal is not None:
            self._refused(refusal, self._parsing)
        self._schedule()

    def _stalled(self) -> None:
        """`send_timeout_s` with the client's socket full: another period if it took some
        of what waits (as nginx's `send_timeout`, between two successful writes), else the
        connection is aborted and counted. Whatever the state: a connection closing after its
        answer (`transport.close` waits to send what is buffered) would otherwise stay open,
        holding its answer and a connection slot, for as long as the client does not read."""
        self._stall = None
        transport = self.transport
        if transport is None or self.lost:
            return
        left = _unsent(transport)
        if left < self._stall_left:
            self._stall_left = left
            self._stall = self.loop.call_later(self.server.limits.send_timeout_s, self._stalled)
            return
        peer, limit = transport.get_extra_info("peername"), self.server.limits.send_timeout_s
        log.info("client %s took nothing for %.0fs: aborted", peer, limit)
        self.server.on_reject("send_timeout")
        self.abort()

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

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

    def pause_body(self) -> None:
        self.pause_reading("body")

    def resume_body(self) -> None:
        self.resume_reading("body")

    def keeps_open(self) -> bool:
        return not self.server.draining and not self.state.closing

    def pause_reading(self, why: str) -> None:
        if not self._paused_by and self.transport is not None and not self.lost:
            self.transport.pause_reading()
            self.state.pause(True, self.loop.time())
        self._paused_by.add(why)

    def resume_reading(self, why: str) -> None:
        if why in self._paused_by:
            self._paused_by.discard(why)
            if not self._paused_by and self.transport is not None and not self.lost:
                self.transport.resume_reading()
                self.state.pause(False, self.loop.time())
                self._schedule()

    def close(self) -> None:
        """Close once what was written has been sent."""
        if not self.state.closed:
            self.state.close()
        if self.transport is not None and not self.lost:
            self.transport.close()

    def abort(self) -> None:
        if not self.state.closed:
            self.state.close()
        if self.transport is not None and not self.lost:
            self.transport.abort()


def _unsent(transport: asyncio.Transport) -> int:
    """Bytes written that the client has not taken: the transport's buffer plus the kernel's
    send queue (`SIOCOUTQ`). The buffer alone moves in steps of the kernel's buffer, which
    signals room only once half of it is free: a client reading slowly but steadily would
    look stalled for seconds at a time."""
    unsent = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            unsent += int.from_bytes(queued, sys.byteorder, signed=True)
    return unsent


def _framing_refusal(headers: Mapping[str, str], version: str) -> str | None:
    """What the parser lets through that RFC 9112 refuses: an HTTP/1.1 request without a
    Host (§3.2; more than one is refused as it arrives), and a transfer coding other than
    `chunked` alone (the parser frames `gzip, chunked` by its last coding and would hand
    the handler gzip bytes; no coding but chunked is decoded here)."""
    if version != "1.0" and "host" not in headers:
        return "missing Host header"
    coding = headers.get("transfer-encoding")
    if coding is not None and coding.strip().lower() != "chunked":
        return f"unsupported transfer coding: {coding}"
    return None


_DROPPED = Refusal(400, "dropped", "the rest of the body was dropped after the answer")


class _Refused(Exception):
    """Raised inside a parser callback to stop it; httptools reports it as a callback error
    with this as the context."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class _Stop(Exception):
    """Raised inside a parser callback once the refusal was handled: stop parsing."""
