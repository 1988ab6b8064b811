"""HTTP/1.1 to engines on asyncio protocols, parsed by httptools (llhttp): both pools' client.

Why not aiohttp's client: it was the largest single cost of a proxied request (about a
quarter of the router's busy time, docs/benchmarks.md "Hot-path profile"), and the router
needs little of it. The data pool and the control pool each have their own `H1Client` (their
own socket bound, so data traffic can never starve health checks). It does what they need and
no more:

- `POST` (or `GET`) with a body and the caller's headers (`Host`, `Content-Length` and
  `Accept-Encoding: identity` added: the router relays and parses raw bytes);
- the answer's status and content type, then its body whole (`read`) or piece by piece as it
  arrives (`readany`), with back-pressure: reading pauses while a reader lags far behind
  (`h1_body.BodyBuffer`, which the client server's request bodies use as well);
- bodies framed by `Content-Length`, chunked, or ended by the engine closing (HTTP/1.0 style);
- keep-alive reuse, and one bound on open sockets, idle ones included: before a new socket
  opens, the oldest idle ones (of any engine) are closed until it fits. With data-plane worker
  processes the bound is the router's (a `SocketBudget` they share): a worker that needs a
  socket when every one is open closes one of its own idle sockets, or, having none, waits
  while the workers that hold idle ones close them;
- HTTPS through `ssl`.

Errors are `ConnectionError`s, which `transport.classify_exception` maps to the spec's
classes: `EngineConnectFailed` (no connection), `EngineConnectionLost` (it ended before the
answer did), `EngineProtocolError` (not HTTP/1.1, or headers over 64 KiB).

An idle socket is kept at most `idle_s` (4 s: below uvicorn's 5 s keep-alive, vLLM's server,
so the engine rarely closes one just as it is reused). If a reused socket still turns out to
be closed before any byte of the answer came back, the request is sent once more on a fresh
socket: the engine had closed it idle, so it never saw the request.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from narwhal.h1_body import BodyBuffer

_MAX_HEAD_BYTES = 64 * 1024
IDLE_S = 4.0
_NO_BODY = frozenset({204, 304})
# Another process that closes a socket cannot wake a waiter here: it looks again this often.
_SHARED_POLL_S = 0.005
# A client holding idle sockets looks this often whether other processes wait for one.
_SHED_CHECK_S = 0.02


class SocketBudget(Protocol):
    """Open sockets shared with other processes' clients (`process/table.SharedSockets`)."""

    def take(self) -> bool:
        """Room for one more socket in the shared bound, taken now if there is."""
        ...

    def give_back(self) -> None: ...

    def want(self, delta: int) -> None:
        """Say that one more (or one fewer) request of this process waits for a socket."""
        ...

    def wanted_elsewhere(self) -> int:
        """How many requests of other processes wait for a socket."""
        ...


class EngineConnectFailed(ConnectionError):
    """No connection to the engine could be opened."""


class EngineConnectionLost(ConnectionError):
    """The connection ended before the answer did."""


class EngineProtocolError(ConnectionError):
    """The engine's answer is not HTTP/1.1 this client can read."""


@dataclass(frozen=True, slots=True)
class _Target:
    origin: tuple[str, int, bool]  # host, port, https
    head: bytes  # the request line and `Host`, ready to be followed by the other headers


def _target(method: str, url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode()
    return _Target((parts.hostname, port, https), head)


def _header_lines(headers: Mapping[str, str], length: int) -> bytes:
    lines = [f"Content-Length: {length}\r\nAccept-Encoding: identity\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} contains a line break")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class _Connection(asyncio.Protocol):
    """One socket to one engine, one request at a time."""

    def __init__(self, client: H1Client, origin: tuple[str, int, bool]) -> None:
        self._client = client
        self.origin = origin
        self._loop = client.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.counted = True  # still counted in the client's open sockets
        self.closing = False  # aborted; its socket is not closed yet
        self.uses = 0
        self.idle_since = 0.0
        self._begin()

    def _begin(self) -> None:
        """Ready for the next answer."""
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.content_type = ""
        self._head_bytes = 0
        self._framed = False
        self._interim = False
        self.head_done: asyncio.Future[None] = self._loop.create_future()
        self.body = BodyBuffer(self._loop, self._pause, self._resume)
        self._keep_alive = False  # read when the answer completes: the parser resets after
        self.received = False

    def _pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    @property
    def complete(self) -> bool:
        return self.body.complete

    # ------------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._client.forget(self)
        if self.body.complete:
            return
        if self.head_done.done() and not self._framed and not self._interim:
            self._finish()  # a body without Content-Length or chunking ends where the socket does
            return
        detail = f": {exc}" if exc is not None else ""
        self._fail(EngineConnectionLost(f"the engine closed the connection{detail}"))

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineProtocolError(f"malformed HTTP answer: {exc}"))
            self.abort()

    # ------------------------------------------------------------------ parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > _MAX_HEAD_BYTES:
            raise EngineProtocolError("answer headers over 64 KiB")
        lower = name.lower()
        if lower == b"content-type":
            self.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif lower in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            self._interim = True  # 1xx: another head follows
            return
        self.status = status
        if status in _NO_BODY:
            self._framed = True
        if not self.head_done.done():
            self.head_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self._head_bytes, self._framed = 0, False
            return
        self._keep_alive = self._parser.should_keep_alive()
        self._finish()

    # ------------------------------------------------------------------ state
    def _finish(self) -> None:
        self.body.finish()
        if not self.head_done.done():
            self.head_done.set_result(None)

    def _fail(self, error: Exception) -> None:
        if not self.body.complete:
            if not self.head_done.done():
                self.head_done.set_exception(error)
                self.head_done.exception()  # retrieved: a caller that left needs no warning
            self.body.fail(error)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.uses += 1
        self.transport.write(data)

    def reusable(self) -> bool:
        """A whole answer read off a socket the engine keeps open. Not one whose reading is
        paused (an answer released unread): idle, it would never notice the engine closing."""
        return self.body.complete and self._keep_alive and not self.closed and not self.body.paused

    def abort(self) -> None:
        """Close at once. The socket counts against the bound until `connection_lost`, when
        asyncio has really closed it (a loop iteration later)."""
        if self.transport is not None and not self.closed:
            self.transport.abort()
            if self.counted:
                self._client.closing += 1
                self.closing = True
        self.closed = True


class EngineResponse:
    """An engine's answer: status and content type at once, the body as it arrives. End it
    with `release` (the socket is reused if the whole answer was read) or `close`."""

    def __init__(self, connection: _Connection, client: H1Client) -> None:
        self._connection = connection
        self._client = client
        self.status = connection.status
        self.content_type = connection.content_type or "application/octet-stream"
        self._done = False
        # The body bytes that arrived since the last call (waiting for some); b"" at its
        # end. The buffer's own method: a stream calls it for every chunk.
        self.readany: Callable[[], Awaitable[bytes]] = connection.body.read_some

    async def read(self) -> bytes:
        body = self._connection.body
        pieces = []
        while piece := await body.read_some():
            pieces.append(piece)
        return b"".join(pieces)

    def at_eof(self) -> bool:
        body = self._connection.body
        return body.complete and body.empty

    def release(self) -> None:
        """Give the socket back for reuse if the answer is complete; otherwise close it."""
        if not self._done:
            self._done = True
            self._client.put_back(self._connection)

    def close(self) -> None:
        """Hang up: the engine sees the disconnect (and aborts the request)."""
        if not self._done:
            self._done = True
            self._connection.abort()
            self._client.put_back(self._connection)


class H1Client:
    """Keep-alive sockets to every engine of one pool, at most `limit` open in total, and
    within `shared`'s bound too when other processes share it."""

    def __init__(
        self,
        limit: int,
        ssl_context: ssl.SSLContext | None = None,
        idle_s: float = IDLE_S,
        shared: SocketBudget | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._limit = limit
        self._shared = shared
        self._shed: asyncio.TimerHandle | None = None
        self._ssl = ssl_context  # made on the first HTTPS connection when not given
        self._idle_s = idle_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open = 0  # sockets open or being opened
        self.closing = 0  # of those, aborted but not closed yet
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._targets: dict[tuple[str, str], _Target] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def idle_sockets(self) -> int:
        return sum(len(connections) for connections in self._idle.values())

    async def request(
        self, method: str, url: str, body: bytes, headers: Mapping[str, str]
    ) -> EngineResponse:
        """Send the request and wait for the answer's head. The caller bounds the time."""
        target = self._targets.get((method, url))
        if target is None:
            target = self._targets[method, url] = _target(method, url)
        data = target.head + _header_lines(headers, len(body)) + body
        for attempt in range(2):
            # The resend takes a new socket: the other idle ones may be as dead (an engine
            # that restarted leaves every one of them so).
            connection = await self._connection(target.origin, reuse=attempt == 0)
            reused = connection.uses > 0
            try:
                connection.send(data)
                await connection.head_done
            except EngineConnectionLost:
                connection.abort()
                if reused and not connection.received:
                    continue  # closed while idle: the engine never saw this request
                raise
            except BaseException:
                connection.abort()  # cancelled or failed mid-answer: never reused
                raise
            return EngineResponse(connection, self)
        raise AssertionError("unreachable: a fresh socket is never `reused`")  # pragma: no cover

    # ------------------------------------------------------------------ the pool
    async def _connection(self, origin: tuple[str, int, bool], reuse: bool) -> _Connection:
        while True:
            idle = self._idle.get(origin) if reuse else None
            now = self.loop.time()
            while idle:
                connection = idle.pop()  # the most recently used: the least likely closed
                if not connection.closed and now - connection.idle_since < self._idle_s:
                    connection._begin()
                    return connection
                connection.abort()
            if self._open < self._limit and (self._shared is None or self._shared.take()):
                break
            await self._wait_for_slot()
        self._open += 1
        host, port, https = origin
        made: list[_Connection] = []

        def protocol() -> _Connection:
            made.append(_Connection(self, origin))
            return made[0]

        try:
            await self.loop.create_connection(
                protocol, host, port, ssl=self._ssl_context() if https else None
            )
        except BaseException as exc:
            if made and made[0].transport is not None:  # cancelled in the TLS handshake, say
                made[0].abort()  # connection_lost will count it out
            elif made:
                self.forget(made[0])
            else:
                self._count_out()
            if isinstance(exc, OSError):
                raise EngineConnectFailed(f"connect failed: {exc}") from exc
            raise
        return made[0]

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()  # the system trust store, SSL_CERT_FILE
        return self._ssl

    async def _wait_for_slot(self) -> None:
        """Close the oldest idle socket, unless one is closing already; then wait until a
        socket is really gone (asyncio closes an aborted one a loop iteration later), so the
        old socket never coexists with the new one, or one comes back idle. With no idle
        socket of its own under a shared bound, wait while other processes close theirs."""
        if not self.closing:
            self._evict_oldest()
        waiter = self.loop.create_future()
        self._slot_waiters.append(waiter)
        shared = self._shared
        try:
            if shared is None:
                await waiter
            else:
                shared.want(1)
                try:
                    await asyncio.wait({waiter}, timeout=_SHARED_POLL_S)
                finally:
                    shared.want(-1)
        finally:
            if waiter in self._slot_waiters:
                self._slot_waiters.remove(waiter)

    def _evict_oldest(self) -> bool:
        """Close the idle socket unused for longest; False if there is none."""
        oldest: _Connection | None = None
        for connections in self._idle.values():
            for c in connections:
                if oldest is None or c.idle_since < oldest.idle_since:
                    oldest = c
        if oldest is None:
            return False
        self._idle[oldest.origin].remove(oldest)
        oldest.abort()
        return True

    def put_back(self, connection: _Connection) -> None:
        if not connection.reusable() or self._closed:
            connection.abort()
            return
        if self._shared is not None and self._shed is None:
            self._shed = self.loop.call_later(_SHED_CHECK_S, self._shed_for_others)
        connection.idle_since = self.loop.time()
        self._idle.setdefault(connection.origin, []).append(connection)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self._idle_s, self._close_expired)
        self._wake_slot_waiters()  # a waiter may reuse it, or close it to open its own

    def _shed_for_others(self) -> None:
        """While this client holds idle sockets: close as many as other processes wait for
        (less those closing already), oldest first."""
        self._shed = None
        assert self._shared is not None
        wanted = self._shared.wanted_elsewhere() - self.closing
        while wanted > 0 and self._evict_oldest():
            wanted -= 1
        if not self._closed and self.idle_sockets:
            self._shed = self.loop.call_later(_SHED_CHECK_S, self._shed_for_others)

    def forget(self, connection: _Connection) -> None:
        """A socket closed: it no longer counts against the bound."""
        if connection.counted:
            connection.counted = False
            if connection.closing:
                self.closing -= 1
            idle = self._idle.get(connection.origin)
            if idle and connection in idle:
                idle.remove(connection)
            self._count_out()

    def _count_out(self) -> None:
        self._open -= 1
        if self._shared is not None:
            # asyncio tells `connection_lost` before it closes the socket: other processes
            # get the room once it is closed (an engine never sees one socket too many).
            self.loop.call_soon(self._shared.give_back)
        self._wake_slot_waiters()

    def _wake_slot_waiters(self) -> None:
        """Every waiter looks again: the first takes the free slot (or the idle socket), and
        each of the others closes another idle socket for itself, or waits on."""
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _close_expired(self) -> None:
        """Close the sockets idle for `idle_s`; run again when the next one will have been."""
        self._sweep = None
        now = self.loop.time()
        oldest: float | None = None
        for connections in self._idle.values():
            for c in list(connections):
                if now - c.idle_since >= self._idle_s:
                    connections.remove(c)
                    c.abort()
                elif oldest is None or c.idle_since < oldest:
                    oldest = c.idle_since
        if oldest is not None and not self._closed:
            self._sweep = self.loop.call_at(oldest + self._idle_s, self._close_expired)

    def close(self) -> None:
        self._closed = True
        for timer in (self._sweep, self._shed):
            if timer is not None:
                timer.cancel()
        for connections in self._idle.values():
            for c in list(connections):
                c.abort()
        self._idle.clear()
