"""The data pool's HTTP/1.1 client (`narwhal.engine.h1`) over real sockets.

Most engines here are raw TCP servers (`asyncio.start_server`) that write exact bytes, so
each test controls the wire: framing, interim heads, early closes, malformed answers, stalls.
One is an aiohttp server, for what a real HTTP server sends.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.engine.h1 import (
    EngineConnectFailed,
    EngineConnectionLost,
    EngineProtocolError,
    H1Client,
)
from narwhal.engine.transport import EngineClient, PoolKind
from narwhal.process.table import SOCKETS_OPEN, SOCKETS_WANTED, SharedSockets, WorkerTable
from tests.support.poll import eventually
from tests.support.sockets import client_ends, client_sockets

# ------------------------------------------------------------------ raw engines


@dataclass
class Request:
    """One request as the engine received it."""

    line: str
    headers: list[tuple[str, str]]
    body: bytes
    connection: int  # the index of the accepted connection it came on

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n.lower() == name.lower()]
        assert len(values) <= 1, (name, values)
        return values[0] if values else None


@dataclass
class Peer:
    """The engine's end of one accepted connection."""

    server: RawServer
    index: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    client_closed: bool = False  # a read saw the client's EOF (or reset)

    async def request(self) -> Request | None:
        """The next request on this connection; None once the client closed it."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.client_closed = True
            return None
        line, *lines = head[:-4].decode("latin-1").split("\r\n")
        headers = [(n, v.strip()) for n, _, v in (h.partition(":") for h in lines)]
        request = Request(line, headers, b"", self.index)
        length = int(request.header("Content-Length") or 0)
        request.body = await self.reader.readexactly(length)
        self.server.requests.append(request)
        return request

    async def wait_client_close(self) -> None:
        """Read (and drop) whatever comes until the client closes the connection."""
        with suppress(ConnectionError):
            while await self.reader.read(65536):
                pass
        self.client_closed = True

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def hang_up(self, reset: bool = False) -> None:
        """Close the connection: a FIN, or a RST when `reset`."""
        if reset:
            sock = self.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.close()


Handler = Callable[[Peer], Awaitable[None]]


@dataclass
class RawServer:
    handler: Handler
    port: int = 0
    peers: list[Peer] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def accepted(self) -> int:
        return len(self.peers)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        peer = Peer(self, len(self.peers), reader, writer)
        self.peers.append(peer)
        try:
            await self.handler(peer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: some tests make it
        except asyncio.CancelledError:
            pass  # the test is over (a cancelled task here would be logged by asyncio)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            writer.close()


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[RawServer]:
    """A TCP server on 127.0.0.1 running `handler` for every accepted connection; at the end
    every connection is closed and any unexpected handler error fails the test."""
    raw = RawServer(handler)
    server = await asyncio.start_server(raw.serve, "127.0.0.1", 0)
    raw.port = server.sockets[0].getsockname()[1]
    try:
        yield raw
    finally:
        server.close()
        for task in list(raw.tasks):
            task.cancel()
        await asyncio.gather(*raw.tasks, return_exceptions=True)
        for peer in raw.peers:
            peer.writer.close()
        await server.wait_closed()
    assert not raw.errors, raw.errors


def answer(
    body: bytes = b"ok", status: bytes = b"200 OK", content_type: bytes | None = b"text/plain"
) -> bytes:
    """A complete Content-Length answer."""
    head = b"HTTP/1.1 " + status + b"\r\n"
    if content_type is not None:
        head += b"Content-Type: " + content_type + b"\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def keep_alive(body: Callable[[Request], bytes] = lambda r: b"ok") -> Handler:
    """An engine that answers every request on a connection, keeping the connection open."""

    async def handler(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            peer.send(answer(body(request)))

    return handler


def counting(ports: set[int], at_accept: list[int], then: Handler | None = None) -> Handler:
    """An engine that notes how many client sockets to `ports` are open as it accepts each
    connection, then serves it (`keep_alive()` unless `then`)."""
    serve = then or keep_alive()

    async def handler(peer: Peer) -> None:
        at_accept.append(client_sockets(ports))
        await serve(peer)

    return handler


def from_connection(request: Request) -> bytes:
    """An answer body naming the connection the request came on."""
    return b"connection %d" % request.connection


def _queued(fd: int, request: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(fd, request, b"\0\0\0\0"))[0])


def _client_unread(ports: set[int]) -> int:
    """Bytes in the client sockets' kernel receive queues: arrived, not yet read by asyncio."""
    return sum(_queued(sock.fileno(), termios.FIONREAD) for sock in client_ends(ports))


def _unsent(writer: asyncio.StreamWriter) -> int:
    """Bytes an engine wrote that the client's kernel has not taken yet: in the transport's
    buffer or the socket's send queue."""
    outq = _queued(writer.get_extra_info("socket").fileno(), termios.TIOCOUTQ)
    return writer.transport.get_write_buffer_size() + outq


async def _sockets_down_to(ports: set[int], at_most: int, timeout_s: float = 2.0) -> None:
    """Wait until at most `at_most` client sockets to `ports` are open (asyncio closes an
    aborted socket a loop iteration later)."""
    await eventually(
        lambda: client_sockets(ports) <= at_most,
        timeout_s=timeout_s,
        what=f"at most {at_most} client sockets to {sorted(ports)}",
    )


async def _fetch(client: H1Client, url: str, body: bytes = b"{}") -> bytes:
    """A whole request: send, read the answer whole, give the socket back."""
    async with asyncio.timeout(2):
        resp = await client.request("POST", url, body, {})
        try:
            assert resp.status == 200
            return await resp.read()
        finally:
            resp.release()


@asynccontextmanager
async def h1_client(limit: int = 4, idle_s: float | None = None) -> AsyncIterator[H1Client]:
    client = H1Client(limit) if idle_s is None else H1Client(limit, idle_s=idle_s)
    try:
        yield client
    finally:
        client.close()


@asynccontextmanager
async def engine_client() -> AsyncIterator[EngineClient]:
    client = EngineClient(data_limit=4, control_limit=1)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


# ------------------------------------------------------------------ answers and framing


async def test_a_content_length_answer_is_read_whole_and_the_request_is_complete() -> None:
    """The basic exchange: the engine gets the request line, `Host`, `Content-Length`,
    `Accept-Encoding: identity` (the router relays raw bytes), the caller's headers and the
    body; the caller gets the status, the bare lower-cased content type (its parameters cut)
    and the body. An answer without a content type is `application/octet-stream`."""

    async def handler(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            if request.line.startswith("POST /raw "):
                peer.send(answer(b"raw", content_type=None))
            else:
                peer.send(answer(b'{"id": 1}', b"201 Created", b"Application/JSON ; charset=UTF-8"))

    headers = {"Content-Type": "application/json", "X-Request-Id": "r-1"}
    async with raw_server(handler) as engine, h1_client() as client, asyncio.timeout(2):
        url = engine.url + "/v1/completions?a=1"
        resp = await client.request("POST", url, b'{"p": 2}', headers)
        try:
            assert (resp.status, resp.content_type) == (201, "application/json")
            assert await resp.read() == b'{"id": 1}'
            assert resp.at_eof()
        finally:
            resp.release()
        resp = await client.request("POST", engine.url + "/raw", b"", {})
        try:
            assert (resp.status, resp.content_type) == (200, "application/octet-stream")
            assert await resp.read() == b"raw"
        finally:
            resp.release()

    first, second = engine.requests
    assert first.line == "POST /v1/completions?a=1 HTTP/1.1"
    assert first.header("Host") == f"127.0.0.1:{engine.port}"
    assert first.header("Content-Length") == "8"
    assert first.header("Accept-Encoding") == "identity"
    assert first.header("Content-Type") == "application/json"
    assert first.header("X-Request-Id") == "r-1"
    assert first.body == b'{"p": 2}'
    assert (second.line, second.header("Content-Length"), second.body) == (
        "POST /raw HTTP/1.1",
        "0",
        b"",
    )


async def test_a_chunked_answer_is_read_piece_by_piece_as_it_arrives() -> None:
    """A streamed answer (SSE from a decode engine): each `readany` returns what arrived
    without waiting for the rest, which the engine sends only once the test has the earlier
    piece; at the end `readany` returns b"" (again and again) and `at_eof` is true."""
    gates = [asyncio.Event(), asyncio.Event()]

    async def handler(peer: Peer) -> None:
        assert await peer.request() is not None
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        peer.send(b"Transfer-Encoding: chunked\r\n\r\n" + b"7\r\ndata: 1\r\n")
        await gates[0].wait()
        peer.send(b"7\r\ndata: 2\r\n")
        await gates[1].wait()
        peer.send(b"9\r\ndata: end\r\n0\r\n\r\n")
        await peer.wait_client_close()

    async with raw_server(handler) as engine, h1_client() as client:
        async with asyncio.timeout(2):
            resp = await client.request("POST", engine.url + "/v1/completions", b"{}", {})
            try:
                assert (resp.status, resp.content_type) == (200, "text/event-stream")
                assert await resp.readany() == b"data: 1"
                assert not resp.at_eof()
                gates[0].set()
                assert await resp.readany() == b"data: 2"
                assert not resp.at_eof()
                gates[1].set()
                rest = b""
                while piece := await resp.readany():
                    rest += piece
                assert rest == b"data: end"
                assert resp.at_eof()
                assert await resp.readany() == b""
            finally:
                resp.release()


async def test_a_body_ended_by_the_engine_closing_is_read_whole() -> None:
    """HTTP/1.0-style framing: no Content-Length, no chunking, `Connection: close`; the body
    is whatever came before the close, and the close is its end, not an error."""

    async def handler(peer: Peer) -> None:
        assert await peer.request() is not None
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        peer.send(b"part one, ")
        await peer.writer.drain()
        peer.send(b"part two")
        peer.hang_up()

    async with raw_server(handler) as engine, h1_client() as client:
        async with asyncio.timeout(2):
            resp = await client.request("POST", engine.url + "/v1/completions", b"{}", {})
            try:
                assert resp.status == 200
                assert await resp.read() == b"part one, part two"
                assert resp.at_eof()
            finally:
                resp.release()


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "two-writes"])
async def test_a_100_continue_head_before_the_answer_is_skipped(split: bool) -> None:
    """An interim `100 Continue` head is not the answer: the caller sees the `200` that
    follows, with its headers and body, whether both heads arrive together or apart."""

    async def handler(peer: Peer) -> None:
        assert await peer.request() is not None
        peer.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        if split:  # the final head goes out once the client has read the interim one
            await eventually(
                lambda: _unsent(peer.writer) == 0 and _client_unread({peer.server.port}) == 0,
                timeout_s=2,
                what="the interim head read by the client",
            )
        peer.send(answer(b"final", content_type=b"application/json"))
        await peer.wait_client_close()

    async with raw_server(handler) as engine, h1_client() as client:
        async with asyncio.timeout(2):
            resp = await client.request("POST", engine.url + "/v1/completions", b"{}", {})
            try:
                assert (resp.status, resp.content_type) == (200, "application/json")
                assert await resp.read() == b"final"
            finally:
                resp.release()


async def test_a_204_without_a_body_completes_and_keeps_the_socket() -> None:
    """`204` has no body even without a Content-Length: reading it completes at once (the
    engine keeps the connection open, so waiting for a close would hang), and the socket is
    reused for the next request."""

    async def handler(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            if request.line.startswith("POST /empty "):
                peer.send(b"HTTP/1.1 204 No Content\r\n\r\n")
            else:
                peer.send(answer())

    async with raw_server(handler) as engine, h1_client() as client:
        async with asyncio.timeout(2):
            resp = await client.request("POST", engine.url + "/empty", b"{}", {})
            try:
                assert resp.status == 204
                assert await resp.read() == b""
                assert resp.at_eof()
            finally:
                resp.release()
            assert await _fetch(client, engine.url + "/next") == b"ok"
    assert engine.accepted == 1


async def test_an_aiohttp_engine_through_the_engine_clients_data_pool() -> None:
    """What a real HTTP server sends, through `EngineClient`'s data pool: a GET with headers
    and no body, a POST answered with a fixed-length JSON body, and one answered chunked."""
    seen: list[tuple[str, str, str | None, str | None, bytes]] = []

    async def record(request: web.Request) -> None:
        body = await request.read()
        headers = request.headers
        seen.append(
            (
                request.method,
                request.path_qs,
                headers.get("X-Test"),
                headers.get("Accept-Encoding"),
                body,
            )
        )

    async def metrics(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(text="up 1\n", content_type="text/plain")

    async def completions(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"choices": []})

    async def stream(request: web.Request) -> web.StreamResponse:
        await record(request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(3):
            await response.write(b"data: %d\n\n" % n)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/stream", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with engine_client() as client:
            got = await client.get(PoolKind.DATA, url + "/metrics?x=1", 2.0, {"X-Test": "g"})
            assert (got.status, got.body, got.content_type) == (200, b"up 1\n", "text/plain")
            posted = await client.post(PoolKind.DATA, url + "/v1/completions", b"{}", {}, 2.0)
            assert (posted.status, posted.content_type) == (200, "application/json")
            assert posted.body == b'{"choices": []}'
            streamed = await client.post(PoolKind.DATA, url + "/stream", b"s", {}, 2.0)
            assert streamed.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert streamed.content_type == "text/event-stream"
    finally:
        await runner.cleanup()
    assert seen == [
        ("GET", "/metrics?x=1", "g", "identity", b""),
        ("POST", "/v1/completions", None, "identity", b"{}"),
        ("POST", "/stream", None, "identity", b"s"),
    ]


# ------------------------------------------------------------------ keep-alive


async def test_keep_alive_reuses_a_socket_only_after_a_whole_answer() -> None:
    """Two requests in turn share one connection. A socket whose answer was released before
    it was complete is closed (its leftover bytes would be read as the next answer), and so
    is one the caller `close`d: the next request opens a new connection."""

    async def handler(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            if request.line.startswith("POST /partial "):
                peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcde")
            else:
                peer.send(answer(from_connection(request)))

    async with raw_server(handler) as engine, h1_client() as client:
        assert await _fetch(client, engine.url + "/a") == b"connection 0"
        assert await _fetch(client, engine.url + "/b") == b"connection 0"
        assert engine.accepted == 1

        async with asyncio.timeout(2):
            resp = await client.request("POST", engine.url + "/partial", b"{}", {})
            assert b"abcde".startswith(await resp.readany())
            resp.release()  # incomplete: closed, never reused
        await eventually(lambda: engine.peers[0].client_closed, timeout_s=2, what="a close")
        assert await _fetch(client, engine.url + "/c") == b"connection 1"
        assert engine.accepted == 2

        async with asyncio.timeout(2):
            resp = await client.request("POST", engine.url + "/d", b"{}", {})
            assert await resp.read() == b"connection 1"
            resp.close()  # whole, but hung up
            resp.release()  # after close: nothing more
        await eventually(lambda: engine.peers[1].client_closed, timeout_s=2, what="a close")
        assert await _fetch(client, engine.url + "/e") == b"connection 2"
        assert engine.accepted == 3
        await _sockets_down_to({engine.port}, 1)


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_a_reused_socket_closed_before_any_answer_byte_is_retried_on_a_fresh_one(
    reset: bool,
) -> None:
    """The keep-alive race: the engine closes an idle socket just as it is reused. Nothing of
    the answer came back, so the engine never handled the request: it is sent once more, on
    a new connection, and the caller sees only the answer."""

    async def handler(peer: Peer) -> None:
        request = await peer.request()
        assert request is not None
        peer.send(answer(from_connection(request)))
        if peer.index == 0:
            assert await peer.request() is not None  # the reuse: hang up without an answer
            peer.hang_up(reset)
            return
        await peer.wait_client_close()

    async with raw_server(handler) as engine, h1_client() as client:
        assert await _fetch(client, engine.url + "/v1/completions") == b"connection 0"
        assert await _fetch(client, engine.url + "/v1/completions") == b"connection 1"
    assert engine.accepted == 2
    assert [r.connection for r in engine.requests] == [0, 0, 1]


async def test_the_resend_after_a_dead_reused_socket_takes_a_fresh_one() -> None:
    """An engine killed and restarted leaves every idle socket to it dead. The request that
    finds one dead is sent again on a new socket, not on the next idle one (which the
    faults bench caught answering a client 500: both tries had met dead sockets)."""

    async def handler(peer: Peer) -> None:
        request = await peer.request()
        assert request is not None
        peer.send(answer(from_connection(request)))
        if peer.index < 2:
            if await peer.request() is not None:  # a reuse: hang up without an answer
                peer.hang_up()
            return
        await peer.wait_client_close()

    async with raw_server(handler) as engine, h1_client() as client:
        url = engine.url + "/v1/completions"
        both = await asyncio.gather(_fetch(client, url), _fetch(client, url))
        assert sorted(both) == [b"connection 0", b"connection 1"]  # two idle sockets now
        assert await _fetch(client, url) == b"connection 2"
    assert engine.accepted == 3


async def test_a_socket_the_engine_closed_while_idle_is_not_reused() -> None:
    """An engine that closes its keep-alive connection after each answer (as uvicorn does
    when its keep-alive timeout runs out): the next request goes out on a new connection and
    succeeds."""

    async def handler(peer: Peer) -> None:
        request = await peer.request()
        assert request is not None
        peer.send(answer(from_connection(request)))
        await peer.writer.drain()
        peer.hang_up()

    async with raw_server(handler) as engine, h1_client() as client:
        assert await _fetch(client, engine.url + "/v1/completions") == b"connection 0"
        await _sockets_down_to({engine.port}, 0)  # the client saw the close
        assert await _fetch(client, engine.url + "/v1/completions") == b"connection 1"
    assert engine.accepted == 2


async def test_a_reused_socket_lost_after_part_of_the_answer_is_not_retried() -> None:
    """Once any byte of the answer came back, the engine did see the request: sending it
    again could run it twice, so the loss is the caller's `EngineConnectionLost`."""

    async def handler(peer: Peer) -> None:
        assert await peer.request() is not None
        peer.send(answer())
        assert await peer.request() is not None
        peer.send(b"HTTP/1.1 200 OK\r\n")
        await peer.writer.drain()
        peer.hang_up()

    async with raw_server(handler) as engine, h1_client() as client:
        assert await _fetch(client, engine.url + "/v1/completions") == b"ok"
        with pytest.raises(EngineConnectionLost):
            async with asyncio.timeout(2):
                await client.request("POST", engine.url + "/v1/completions", b"{}", {})
    assert engine.accepted == 1
    assert len(engine.requests) == 2


async def test_a_fresh_socket_closed_without_an_answer_is_a_lost_connection() -> None:
    """A new connection closed before any answer is the engine's failure, not the keep-alive
    race: no retry (the engine got the request), `EngineConnectionLost`, which the data
    pool reports as a CONNECTION failure."""

    async def handler(peer: Peer) -> None:
        assert await peer.request() is not None
        peer.hang_up()

    async with raw_server(handler) as engine:
        async with h1_client() as client:
            with pytest.raises(EngineConnectionLost):
                async with asyncio.timeout(2):
                    await client.request("POST", engine.url + "/v1/completions", b"{}", {})
        assert engine.accepted == 1  # a retry would have connected again before failing
        async with engine_client() as client:
            with pytest.raises(EngineFailure) as failure:
                await client.post(PoolKind.DATA, engine.url + "/v1/completions", b"{}", {}, 2.0)
        assert engine.accepted == 2
    assert failure.value.failure_class is FailureClass.CONNECTION
    assert failure.value.detail.startswith("connection lost"), failure.value.detail
    assert not failure.value.timed_out


# ------------------------------------------------------------------ failures


def _closed_port() -> int:
    """A port nothing listens on (bound, read, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_refused_connection_is_a_connect_failure() -> None:
    """Nothing listening: `EngineConnectFailed` from the client, a CONNECTION failure whose
    detail starts with "connect failed" from the data pool; and the failed attempt gives its
    place under the bound back (with a bound of 1, the next request still connects)."""
    url = f"http://127.0.0.1:{_closed_port()}/v1/completions"
    async with raw_server(keep_alive()) as engine:
        async with h1_client(limit=1) as client:
            for _ in range(2):
                with pytest.raises(EngineConnectFailed):
                    async with asyncio.timeout(2):
                        await client.request("POST", url, b"{}", {})
            assert await _fetch(client, engine.url + "/v1/completions") == b"ok"
        async with engine_client() as client:
            with pytest.raises(EngineFailure) as failure:
                await client.post(PoolKind.DATA, url, b"{}", {}, 2.0)
    assert failure.value.failure_class is FailureClass.CONNECTION
    assert failure.value.detail.startswith("connect failed"), failure.value.detail


async def test_a_malformed_answer_is_a_protocol_error() -> None:
    """An answer that is not HTTP/1.1 is `EngineProtocolError` (a CONNECTION failure in the
    data pool), and the socket is dropped."""

    async def handler(peer: Peer) -> None:
        assert await peer.request() is not None
        peer.send(b"garbage\r\n\r\n")
        await peer.wait_client_close()

    async with raw_server(handler) as engine:
        async with h1_client() as client:
            with pytest.raises(EngineProtocolError):
                async with asyncio.timeout(2):
                    await client.request("POST", engine.url + "/v1/completions", b"{}", {})
            await eventually(lambda: engine.peers[0].client_closed, timeout_s=2, what="a close")
        async with engine_client() as client:
            with pytest.raises(EngineFailure) as failure:
                await client.post(PoolKind.DATA, engine.url + "/v1/completions", b"{}", {}, 2.0)
    assert failure.value.failure_class is FailureClass.CONNECTION


async def _cut_short(peer: Peer) -> None:
    """An engine that promises 100 bytes, sends 10 and closes."""
    assert await peer.request() is not None
    peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"0123456789")
    await peer.writer.drain()
    peer.hang_up()


async def test_a_body_cut_short_is_a_lost_connection() -> None:
    """Content-Length 100, 10 bytes, then the close: `read` raises `EngineConnectionLost`
    rather than returning a truncated body as if it were whole."""
    async with raw_server(_cut_short) as engine, h1_client() as client:
        async with asyncio.timeout(2):
            resp = await client.request("POST", engine.url + "/v1/completions", b"{}", {})
            try:
                with pytest.raises(EngineConnectionLost):
                    await resp.read()
            finally:
                resp.release()


async def test_a_stream_cut_short_gives_what_arrived_then_the_error() -> None:
    """Through `EngineClient.stream`: the bytes that arrived before the close are returned
    first (the router relays them), even when the close has already been seen; only then
    does `readany` raise `EngineConnectionLost`."""
    async with raw_server(_cut_short) as engine, engine_client() as client:
        async with asyncio.timeout(2):
            resp = await client.stream(engine.url + "/v1/completions", b"{}", {})
            try:
                await _sockets_down_to({engine.port}, 0)  # the close was seen
                assert await resp.readany() == b"0123456789"
                with pytest.raises(EngineConnectionLost):
                    await resp.readany()
                assert not resp.at_eof()
            finally:
                resp.close()


async def test_answer_headers_over_64_kib_are_a_protocol_error() -> None:
    """The head is bounded: headers past 64 KiB are `EngineProtocolError`, not memory
    without end; a large head within the bound (48 KiB) is read."""
    pad = b"a" * 1000

    async def handler(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            count = 48 if request.line.startswith("POST /within ") else 70
            headers = b"".join(b"X-Pad-%d: %s\r\n" % (n, pad) for n in range(count))
            peer.send(b"HTTP/1.1 200 OK\r\n" + headers + b"Content-Length: 2\r\n\r\nok")

    async with raw_server(handler) as engine, h1_client() as client:
        assert await _fetch(client, engine.url + "/within") == b"ok"
        with pytest.raises(EngineProtocolError):
            async with asyncio.timeout(2):
                await client.request("POST", engine.url + "/over", b"{}", {})


async def test_a_header_with_a_line_break_is_refused_before_sending() -> None:
    """A line break in a header name or value would let a caller smuggle headers or a second
    request: `ValueError`, and not a byte goes out (the keep-alive socket carries only the
    requests before and after)."""
    async with raw_server(keep_alive()) as engine, h1_client() as client:
        assert await _fetch(client, engine.url + "/before") == b"ok"
        for headers in (
            {"X-Test": "a\r\nX-Injected: 1"},
            {"X-Test": "a\nb"},
            {"X-Test": "a\rb"},
            {"X-In\r\njected": "1"},
        ):
            with pytest.raises(ValueError):
                await client.request("POST", engine.url + "/bad", b"{}", headers)
        assert await _fetch(client, engine.url + "/after") == b"ok"
    assert [r.line for r in engine.requests] == ["POST /before HTTP/1.1", "POST /after HTTP/1.1"]
    assert all(r.header("X-Injected") is None for r in engine.requests)
    # No connection was opened for the refused ones either: each carried a good request.
    assert engine.accepted == len({r.connection for r in engine.requests})


# ------------------------------------------------------------------ the bound and idle sockets


async def test_the_bound_counts_idle_sockets_across_engines() -> None:
    """With a bound of 1 and two engines used in turn, the idle socket to one engine is
    closed before a socket to the other opens: never two sockets at once, counted when each
    engine accepts and after each request."""
    ports: set[int] = set()
    at_accept: list[int] = []
    handler = counting(ports, at_accept)

    async with raw_server(handler) as a, raw_server(handler) as b, h1_client(limit=1) as client:
        ports.update({a.port, b.port})
        for url in (a.url, b.url, a.url, b.url):
            assert await _fetch(client, url + "/v1/completions") == b"ok"
            await _sockets_down_to(ports, 1)
        assert client_sockets(ports) == 1  # the last one stays, for reuse
        assert await _fetch(client, b.url + "/v1/completions") == b"ok"  # and is reused
        assert (a.accepted, b.accepted) == (2, 2)
    assert at_accept and max(at_accept) <= 1, at_accept


async def test_requests_at_the_bound_each_close_an_idle_socket_for_their_own() -> None:
    """The data plane's pattern at the bound: every socket sits idle to the prefill engine
    when as many requests at once need the decode engine. Each closes an idle socket of its
    own and opens one; none waits for another to finish (a second waiter once slept until a
    socket came free on its own), and the bound holds throughout."""
    ports: set[int] = set()
    at_accept: list[int] = []
    handler = counting(ports, at_accept)

    async with raw_server(handler) as prefill, raw_server(handler) as decode:
        ports.update({prefill.port, decode.port})
        async with h1_client(limit=3) as client:
            urls = [prefill.url + "/v1/completions"] * 3
            assert await asyncio.gather(*(_fetch(client, u) for u in urls)) == [b"ok"] * 3
            assert prefill.accepted == 3  # three sockets, all idle now
            urls = [decode.url + "/v1/completions"] * 3
            async with asyncio.timeout(1):
                assert await asyncio.gather(*(_fetch(client, u) for u in urls)) == [b"ok"] * 3
            assert decode.accepted == 3
    assert max(at_accept) <= 3, at_accept


@asynccontextmanager
async def shared_clients(limit: int) -> AsyncIterator[tuple[H1Client, H1Client, WorkerTable]]:
    """Two clients that share one bound the way two data-plane workers do: through the
    workers' real table (one process here; `lockf` is the same lock for both)."""
    table = WorkerTable.create(2)
    a = H1Client(limit, shared=SharedSockets(table, 0, limit))
    b = H1Client(limit, shared=SharedSockets(table, 1, limit))
    try:
        yield a, b, table
    finally:
        a.close()
        b.close()
        await eventually(lambda: table.total(SOCKETS_OPEN) == 0, what="every socket counted out")
        table.close()


async def test_a_shared_bound_makes_another_client_close_its_idle_sockets() -> None:
    """Worker A's two sockets sit idle when worker B needs one, at a router-wide bound of 2:
    B has none of its own to close, so it says it waits and A closes its oldest idle socket.
    The bound holds at every accept, and the table counts each socket once."""
    ports: set[int] = set()
    at_accept: list[int] = []
    handler = counting(ports, at_accept)

    async with (
        raw_server(handler) as prefill,
        raw_server(handler) as decode,
        shared_clients(limit=2) as (a, b, table),
    ):
        ports.update({prefill.port, decode.port})
        urls = [prefill.url + "/v1/completions"] * 2
        assert await asyncio.gather(*(_fetch(a, u) for u in urls)) == [b"ok"] * 2
        assert (table.get(0, SOCKETS_OPEN), table.total(SOCKETS_OPEN)) == (2, 2)
        async with asyncio.timeout(1):
            assert await _fetch(b, decode.url + "/v1/completions") == b"ok"
        assert (table.get(0, SOCKETS_OPEN), table.get(1, SOCKETS_OPEN)) == (1, 1)
        assert table.total(SOCKETS_WANTED) == 0
    assert at_accept and max(at_accept) <= 2, at_accept


async def test_a_client_that_waits_gets_a_socket_another_gave_back_idle() -> None:
    """Worker A uses both sockets of the bound; worker B waits for one. The sockets A gives
    back go idle (A reuses them), and A closes one within its 20 ms look at who waits, so B
    opens its own well within a second; the bound holds at every accept. (Closing every
    socket given back while another waits was measured: neither worker then ever reused a
    socket, 1.8x the CPU per request at the bound; docs/performance-log.md.)"""
    ports: set[int] = set()
    at_accept: list[int] = []
    go = asyncio.Event()

    async def slow(peer: Peer) -> None:
        while (await peer.request()) is not None:
            await go.wait()
            peer.send(answer())

    async with (
        raw_server(counting(ports, at_accept, slow)) as prefill,
        raw_server(counting(ports, at_accept)) as decode,
        shared_clients(limit=2) as (a, b, table),
    ):
        ports.update({prefill.port, decode.port})
        held = [asyncio.create_task(_fetch(a, prefill.url + "/v1/completions")) for _ in range(2)]
        await eventually(lambda: prefill.accepted == 2, what="both sockets in use")
        waiting = asyncio.create_task(_fetch(b, decode.url + "/v1/completions"))
        await eventually(lambda: table.total(SOCKETS_WANTED) == 1, what="B waits")
        assert not waiting.done()
        go.set()
        async with asyncio.timeout(1):
            assert await asyncio.gather(*held) == [b"ok"] * 2
            assert await waiting == b"ok"
        assert decode.accepted == 1
        assert table.get(0, SOCKETS_OPEN) <= 1
    assert len(at_accept) == 3 and max(at_accept) <= 2, at_accept


async def test_an_idle_socket_is_closed_after_idle_s() -> None:
    """An idle keep-alive socket is kept at most `idle_s`, then closed by the client (before
    the engine's own keep-alive timeout would close it under a reuse); the next request
    opens a new connection."""
    async with raw_server(keep_alive(from_connection)) as engine, h1_client(4, 0.2) as client:
        assert await _fetch(client, engine.url + "/v1/completions") == b"connection 0"
        assert client_sockets({engine.port}) == 1
        await _sockets_down_to({engine.port}, 0, timeout_s=1.0)
        await eventually(lambda: engine.peers[0].client_closed, timeout_s=1, what="a close")
        assert await _fetch(client, engine.url + "/v1/completions") == b"connection 1"
        assert engine.accepted == 2


async def test_a_lagging_reader_pauses_reading_from_the_engine() -> None:
    """Back-pressure: while the caller does not read, the client stops reading the socket,
    so a large answer backs up into the engine (its write buffer stays full and stops
    moving) instead of into the router's memory; reading then yields every byte, in order."""
    chunks = [bytes([n]) * 65536 for n in range(256)]  # 16 MiB: more than the kernel buffers
    written = [0]
    writers: list[asyncio.StreamWriter] = []

    async def handler(peer: Peer) -> None:
        assert await peer.request() is not None
        writers.append(peer.writer)
        peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for chunk in chunks:
            peer.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await peer.writer.drain()
            written[0] += 1
        peer.send(b"0\r\n\r\n")
        await peer.wait_client_close()

    async with raw_server(handler) as engine, h1_client() as client:
        async with asyncio.timeout(5):
            resp = await client.request("POST", engine.url + "/v1/completions", b"{}", {})
            try:
                history: list[tuple[int, int]] = []

                def stalled() -> bool:
                    history.append((writers[0].transport.get_write_buffer_size(), written[0]))
                    last = history[-5:]
                    return len(last) == 5 and len(set(last)) == 1 and last[0][0] > 0

                await eventually(stalled, timeout_s=3, what="the engine's writes to stall")
                assert written[0] < len(chunks)
                received = bytearray()
                while piece := await resp.readany():
                    received += piece
                assert len(received) == sum(map(len, chunks))
                assert received == b"".join(chunks)
                assert resp.at_eof()
            finally:
                resp.release()


async def test_an_answer_released_unread_leaves_the_engine_usable() -> None:
    """An answer that arrived whole while its reader lagged (over 256 KiB buffered, so
    reading from the socket paused) and was then released unread: `release` may keep the
    socket, but not still paused, or the next request on it would wait for an answer the
    client never reads. The next request to the engine must be answered.

    The engine sends 240 KiB, waits until the client's protocol has all of it (nothing
    unsent, nothing unread in the client's kernel queue), then the last 30 KiB in one write:
    one read by the client that both pauses reading and completes the answer."""
    body = bytes(range(256)) * (270 * 4)
    split = 240 * 1024
    gate = asyncio.Event()
    sent: list[asyncio.StreamWriter] = []

    async def handler(peer: Peer) -> None:
        if peer.index == 0:  # the large answer, on the first connection only
            assert await peer.request() is not None
            head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
            peer.send(head + body[:split])
            sent.append(peer.writer)
            await gate.wait()
            peer.send(body[split:])
            sent.append(peer.writer)
        while (request := await peer.request()) is not None:
            peer.send(answer(from_connection(request)))

    async with raw_server(handler) as engine, h1_client() as client:

        def delivered(writes: int) -> bool:
            """The engine's first `writes` writes are all in the client's protocol."""
            return (
                len(sent) >= writes and _unsent(sent[0]) == 0 and _client_unread({engine.port}) == 0
            )

        async with asyncio.timeout(2):
            resp = await client.request("POST", engine.url + "/v1/completions", b"{}", {})
        await eventually(lambda: delivered(1), timeout_s=2, what="the first 240 KiB delivered")
        gate.set()
        await eventually(lambda: delivered(2), timeout_s=2, what="the whole answer delivered")
        assert resp.status == 200
        resp.release()
        # Reused (reading resumed) or closed: either way the engine answers the next one.
        assert await _fetch(client, engine.url + "/v1/completions") in (
            b"connection 0",
            b"connection 1",
        )


async def test_a_cancelled_request_aborts_its_socket() -> None:
    """A caller's deadline that runs out while waiting for the head hangs up: the engine
    sees the close (and can stop working on the request), the socket is never reused, and
    its place under the bound is free again (a bound of 1 still lets the next one through)."""

    async def handler(peer: Peer) -> None:
        request = await peer.request()
        assert request is not None
        if peer.index == 0:
            await peer.wait_client_close()  # never answers
            return
        peer.send(answer(from_connection(request)))
        await peer.wait_client_close()

    async with raw_server(handler) as engine, h1_client(limit=1) as client:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.request("POST", engine.url + "/v1/completions", b"{}", {})
        await eventually(lambda: engine.peers[0].client_closed, timeout_s=2, what="a close")
        assert await _fetch(client, engine.url + "/v1/completions") == b"connection 1"
        assert engine.accepted == 2
