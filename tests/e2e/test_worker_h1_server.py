"""The data-plane workers' HTTP/1.1 server (`narwhal.process.h1_server`) over real sockets.

Each test runs an `H1Server` in its own loop with small handlers and talks to it with raw TCP
clients (`asyncio.open_connection`) that write exact bytes and read the exact answer, so the
wire is what is checked: heads, framing, keep-alive, pipelining, request bodies, limits and
errors, streams and back-pressure, disconnects, idle timeouts, drains. Waits are polls with a
deadline (`eventually`) or reads under a timeout, never sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import orjson
import pytest

from narwhal.process.h1_server import KEEPALIVE_S, LINGER_S, H1Server, Handler, ServerRequest
from narwhal.process.h1_state import Limits
from tests.support.poll import eventually

HOST = "127.0.0.1"
WAIT_S = 2.0  # the longest any single read here may take

# ------------------------------------------------------------------ the wire, client side


@dataclass
class Reply:
    """One answer as the client read it (header names lower-cased)."""

    version: str
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)  # a chunked body's pieces

    def json(self) -> Any:
        return orjson.loads(self.body)


def _parse_head(head: bytes) -> Reply:
    line, *lines = head[:-4].decode("latin-1").split("\r\n")
    version, status, reason = line.split(" ", 2)
    headers: dict[str, str] = {}
    for text in lines:
        name, sep, value = text.partition(":")
        assert sep, f"a header line without a colon: {text!r}"
        key = name.strip().lower()
        assert key not in headers, f"{key} sent twice"
        headers[key] = value.strip()
    return Reply(version, int(status), reason, headers)


async def _read_reply(reader: asyncio.StreamReader, head_only: bool) -> Reply:
    reply = _parse_head(await reader.readuntil(b"\r\n\r\n"))
    if head_only:
        return reply
    if reply.headers.get("transfer-encoding") == "chunked":
        assert "content-length" not in reply.headers
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            assert data[-2:] == b"\r\n", data[-2:]
            if size == 0:
                break
            reply.chunks.append(data[:-2])
        reply.body = b"".join(reply.chunks)
    else:
        reply.body = await reader.readexactly(int(reply.headers["content-length"]))
    return reply


@dataclass
class Client:
    """A raw HTTP/1.1 client: exact bytes out, whole answers in."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def reply(self, head_only: bool = False, timeout_s: float = WAIT_S) -> Reply:
        """The next answer: its head, and its body (by Content-Length or chunked) unless
        `head_only` (the answer to a HEAD)."""
        async with asyncio.timeout(timeout_s):
            return await _read_reply(self.reader, head_only)

    async def until_closed(self, timeout_s: float = WAIT_S) -> bytes:
        """Read until the server closes the connection; what came before the close (a reset
        counts as a close)."""
        rest = b""
        async with asyncio.timeout(timeout_s):
            with suppress(ConnectionResetError):
                while piece := await self.reader.read(65536):
                    rest += piece
        return rest


@asynccontextmanager
async def connect(port: int, limit: int = 2**16) -> AsyncIterator[Client]:
    reader, writer = await asyncio.open_connection(HOST, port, limit=limit)
    try:
        yield Client(reader, writer)
    finally:
        writer.close()
        with suppress(ConnectionError):
            await writer.wait_closed()


def get(path: str, *headers: str, method: str = "GET", version: str = "1.1") -> bytes:
    lines = "".join(f"{h}\r\n" for h in ("Host: test", *headers))
    return f"{method} {path} HTTP/{version}\r\n{lines}\r\n".encode("latin-1")


def post(path: str, body: bytes, *headers: str, method: str = "POST") -> bytes:
    return get(path, f"Content-Length: {len(body)}", *headers, method=method) + body


def assert_openai_error(reply: Reply, status: int, type_: str) -> dict[str, Any]:
    assert reply.status == status, reply
    assert reply.headers["content-type"] == "application/json", reply
    doc = reply.json()
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert (doc["error"]["type"], doc["error"]["code"]) == (type_, status)
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    return dict(doc["error"])


# ------------------------------------------------------------------ the server


def answering(body: bytes = b"ok", content_type: str = "text/plain") -> Handler:
    async def handler(request: ServerRequest) -> None:
        request.respond(200, body, content_type)

    return handler


async def not_found(request: ServerRequest) -> None:
    request.respond(404, b"no such path", "text/plain")


MODELS = b'{"object": "list", "data": []}'
BASIC: dict[str, dict[str, Handler]] = {
    "/v1/models": {"GET": answering(MODELS, "application/json")}
}


@asynccontextmanager
async def serving(
    routes: Mapping[str, Mapping[str, Handler]],
    fallback: Handler = not_found,
    keepalive_s: float = KEEPALIVE_S,
    linger_s: float = LINGER_S,
    limits: Limits | None = None,
) -> AsyncIterator[tuple[H1Server, int]]:
    """An `H1Server` on a free loopback port, in this test's loop; drained (every connection
    aborted) at the end."""
    server = H1Server(routes, fallback, keepalive_s=keepalive_s, linger_s=linger_s, limits=limits)
    await server.start(HOST, 0)
    port = server.port
    try:
        yield server, port
    finally:
        await server.drain(0)
        await eventually(
            lambda: not server.connections, timeout_s=WAIT_S, what="every connection closed"
        )


def flagged(flags: list[str], name: str) -> Callable[[], bool]:
    """A probe for `eventually`: `name` is among `flags`."""
    return lambda: name in flags


# ------------------------------------------------------------------ answers and keep-alive


async def test_a_get_answered_with_respond_has_a_whole_head_and_keeps_the_connection() -> None:
    """The basic exchange: a GET's handler sees the method, path, query and (lower-cased)
    headers, and its `respond` goes out as `HTTP/1.1 200 OK` with the content type, the
    current `Date`, the handler's extra headers, `Content-Length` and the body, without
    `Connection: close`; a second request on the same connection is answered too."""
    seen: list[tuple[str, str, str, str | None]] = []

    async def hello(request: ServerRequest) -> None:
        seen.append((request.method, request.path, request.query, request.headers.get("x-test")))
        request.respond(200, b"hello", "text/plain; charset=utf-8", {"X-Extra": "1"})

    async with serving({"/hello": {"GET": hello}}) as (server, port), connect(port) as client:
        before = time.time()
        client.send(get("/hello?a=1&b=2", "X-Test: t"))
        first = await client.reply()
        client.send(get("/hello"))
        second = await client.reply()
        assert len(server.connections) == 1

    assert (first.version, first.status, first.reason) == ("HTTP/1.1", 200, "OK")
    assert first.headers["content-type"] == "text/plain; charset=utf-8"
    assert first.headers["content-length"] == "5"
    assert first.headers["x-extra"] == "1"
    assert "connection" not in first.headers
    assert abs(parsedate_to_datetime(first.headers["date"]).timestamp() - before) < 5
    assert first.body == second.body == b"hello"
    assert seen == [("GET", "/hello", "a=1&b=2", "t"), ("GET", "/hello", "", None)]


@pytest.mark.parametrize(
    "request_bytes",
    [get("/hello", "Connection: close"), get("/hello", version="1.0")],
    ids=["http11-connection-close", "http10"],
)
async def test_a_client_that_does_not_keep_alive_gets_connection_close_and_a_close(
    request_bytes: bytes,
) -> None:
    """A client that says `Connection: close` (or speaks HTTP/1.0 without asking for
    keep-alive) is answered with `Connection: close`, and the server then closes the
    connection: nothing more arrives, and the server forgets it."""
    async with serving({"/hello": {"GET": answering(b"bye")}}) as (server, port):
        async with connect(port) as client:
            client.send(request_bytes)
            reply = await client.reply()
            assert await client.until_closed() == b""
        await eventually(lambda: not server.connections, timeout_s=WAIT_S, what="forgotten")
    assert (reply.status, reply.body) == (200, b"bye")
    assert reply.headers["connection"].lower() == "close"


async def test_pipelined_requests_are_answered_one_at_a_time_in_order() -> None:
    """Two requests written in one `write`: the second's handler starts only once the first
    (slow: it waits for the test) has answered, and the answers come back in request order."""
    order: list[str] = []
    release = asyncio.Event()

    async def slow(request: ServerRequest) -> None:
        order.append("slow")
        await release.wait()
        request.respond(200, b"first", "text/plain")

    async def fast(request: ServerRequest) -> None:
        order.append("fast")
        request.respond(200, b"second", "text/plain")

    routes = {"/slow": {"GET": slow}, "/fast": {"GET": fast}}
    async with serving(routes) as (_, port), connect(port) as client:
        client.send(get("/slow") + get("/fast"))
        await eventually(lambda: order == ["slow"], timeout_s=WAIT_S, what="the slow handler")
        release.set()
        first = await client.reply()
        second = await client.reply()
    assert (first.body, second.body) == (b"first", b"second")
    assert order == ["slow", "fast"]


# ------------------------------------------------------------------ request bodies


async def test_a_content_length_body_is_read_whole_and_exact() -> None:
    """A POST body with `Content-Length`, larger than the read buffer's high water (so
    reading pauses and resumes as the handler takes it), with bytes that look like framing:
    `read()` returns exactly what was sent, `content_length` is the declared length, and the
    connection serves the next request."""
    body = bytes(range(256)) * 1200 + b"\r\n\r\n0\r\n\r\n"  # 300 KiB and some
    seen: list[tuple[int | None, bytes]] = []

    async def echo(request: ServerRequest) -> None:
        data = await request.read()
        seen.append((request.content_length, data))
        request.respond(200, b"%d" % len(data), "text/plain")

    async with serving({"/upload": {"POST": echo}} | BASIC) as (_, port), connect(port) as client:
        client.send(post("/upload", body, "Content-Type: application/octet-stream"))
        reply = await client.reply()
        client.send(get("/v1/models"))
        after = await client.reply()
    assert reply.body == b"%d" % len(body)
    assert seen == [(len(body), body)]
    assert after.body == MODELS


async def test_a_chunked_body_reaches_the_handler_piece_by_piece_as_it_arrives() -> None:
    """A `Transfer-Encoding: chunked` body sent in pieces, the next only once the handler
    has the previous one: `read_some()` returns each piece as it comes (decoded, binary bytes
    intact), then b"" at the end; `content_length` is None; the connection is kept."""
    pieces: list[bytes] = []
    lengths: list[int | None] = []

    async def upload(request: ServerRequest) -> None:
        lengths.append(request.content_length)
        while piece := await request.read_some():
            pieces.append(piece)
        request.respond(200, b"".join(pieces), "application/octet-stream")

    async with serving({"/upload": {"POST": upload}} | BASIC) as (_, port), connect(port) as client:
        client.send(get("/upload", "Transfer-Encoding: chunked", method="POST"))
        client.send(b"5\r\nhello\r\n")
        await eventually(lambda: pieces == [b"hello"], timeout_s=WAIT_S, what="the first piece")
        client.send(b"7\r\n, world\r\n3\r\n\x00\r\n\r\n")
        await eventually(
            lambda: b"".join(pieces) == b"hello, world\x00\r\n",
            timeout_s=WAIT_S,
            what="the second write",
        )
        client.send(b"0\r\n\r\n")
        reply = await client.reply()
        client.send(get("/v1/models"))
        after = await client.reply()
    assert reply.body == b"hello, world\x00\r\n"
    assert lengths == [None]
    assert after.body == MODELS


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    """A client that sends `Expect: 100-continue` waits for `HTTP/1.1 100 Continue` before
    sending its body: it gets that interim head (and nothing else) while the body is still
    unsent, then the final answer, built from the body."""

    async def echo(request: ServerRequest) -> None:
        request.respond(200, await request.read(), "text/plain")

    async with serving({"/upload": {"POST": echo}}) as (_, port), connect(port) as client:
        client.send(get("/upload", "Content-Length: 5", "Expect: 100-continue", method="POST"))
        async with asyncio.timeout(WAIT_S):
            interim = await client.reader.readuntil(b"\r\n\r\n")
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.send(b"hello")
        reply = await client.reply()
    assert (reply.status, reply.body) == (200, b"hello")


# ------------------------------------------------------------------ limits and errors


@pytest.mark.parametrize("path", ["/v1/models", "/dashboard"], ids=["openai-path", "other"])
async def test_a_head_over_64_kib_is_refused_with_431_and_the_connection_closed(
    path: str,
) -> None:
    """A request head over 64 KiB is refused with `431` (never reaching a handler), in the
    OpenAI error shape whatever the path; the answer says `Connection: close` and the server
    closes."""
    called: list[str] = []

    async def handler(request: ServerRequest) -> None:
        called.append(request.path)
        request.respond(200, b"ok", "text/plain")

    routes = {"/v1/models": {"GET": handler}, "/dashboard": {"GET": handler}}
    async with serving(routes) as (_, port), connect(port) as client:
        client.send(get(path, "X-Big: " + "a" * (70 * 1024)))
        reply = await client.reply()
        assert await client.until_closed() == b""
    assert reply.headers["connection"].lower() == "close"
    assert "too large" in assert_openai_error(reply, 431, "invalid_request_error")["message"]
    assert called == []


@pytest.mark.parametrize(
    ("request_bytes", "openai"),
    [
        (b"NOT HTTP\r\n\r\n", False),
        (b"GET /v1/models HTTP/1.1\r\nHost: test\r\nNo colon here\r\n\r\n", True),
    ],
    ids=["not-http", "bad-header-on-openai-path"],
)
async def test_a_malformed_request_gets_400_and_the_connection_closed(
    request_bytes: bytes, openai: bool
) -> None:
    """Bytes that are not HTTP get `400` and a close, never a handler, in the OpenAI error
    shape (`openai`: the request line named a `/v1/*` path; the shape is the same)."""
    called: list[str] = []

    async def handler(request: ServerRequest) -> None:
        called.append(request.path)
        request.respond(200, b"ok", "text/plain")

    async with (
        serving({"/v1/models": {"GET": handler}}, handler) as (_, port),
        connect(port) as client,
    ):
        client.send(request_bytes)
        reply = await client.reply()
        assert await client.until_closed() == b""
    assert reply.headers["connection"].lower() == "close"
    error = assert_openai_error(reply, 400, "invalid_request_error")
    assert error["message"].startswith("malformed HTTP request")
    assert called == []


async def test_a_wrong_method_on_a_known_path_is_405_with_allow() -> None:
    """A known path asked with a method it does not serve: `405` with `Allow` naming what it
    serves and an OpenAI-shaped body; no handler runs (not even the fallback), and the
    connection is kept for the next request."""
    called: list[str] = []

    async def handler(request: ServerRequest) -> None:
        called.append(f"{request.method} {request.path}")
        request.respond(200, b"ok", "text/plain")

    routes = {"/v1/models": {"GET": handler}, "/v1/completions": {"POST": handler}}
    async with serving(routes, handler) as (_, port), connect(port) as client:
        client.send(post("/v1/models", b"{}"))
        wrong_post = await client.reply()
        client.send(get("/v1/completions", method="DELETE"))
        wrong_delete = await client.reply()
        assert called == []
        client.send(get("/v1/models"))
        after = await client.reply()
    assert_openai_error(wrong_post, 405, "invalid_request_error")
    assert wrong_post.headers["allow"] == "GET, HEAD"  # HEAD is served on a GET route
    assert_openai_error(wrong_delete, 405, "invalid_request_error")
    assert wrong_delete.headers["allow"] == "POST"
    assert (after.status, after.body) == (200, b"ok")
    assert called == ["GET /v1/models"]


async def test_an_unknown_path_goes_to_the_fallback() -> None:
    """Every path not in the routes (any method) is the fallback's, which sees the whole
    request (method, path and query, headers, body) and answers it; the connection is kept."""
    seen: list[tuple[str, str, str | None, bytes]] = []

    async def fallback(request: ServerRequest) -> None:
        body = await request.read()
        seen.append((request.method, request.path_qs, request.headers.get("authorization"), body))
        request.respond(202, b"forwarded", "text/plain", {"Retry-After": "1"})

    async with serving(BASIC, fallback) as (_, port), connect(port) as client:
        client.send(get("/metrics?x=1", "Authorization: Bearer t"))
        first = await client.reply()
        client.send(post("/admin/engines", b'{"id": "e"}'))
        second = await client.reply()
    assert (first.status, first.reason, first.body) == (202, "Accepted", b"forwarded")
    assert first.headers["retry-after"] == "1"
    assert second.status == 202
    assert seen == [
        ("GET", "/metrics?x=1", "Bearer t", b""),
        ("POST", "/admin/engines", None, b'{"id": "e"}'),
    ]


async def test_head_on_a_get_route_answers_the_head_without_the_body() -> None:
    """`HEAD` on a path that serves GET runs the GET handler, and its answer is the head
    alone: the `Content-Length` of the body a GET would get, and no body bytes (the next
    answer on the connection starts right after the head)."""
    methods: list[str] = []

    async def models(request: ServerRequest) -> None:
        methods.append(request.method)
        request.respond(200, MODELS, "application/json")

    async with serving({"/v1/models": {"GET": models}}) as (_, port), connect(port) as client:
        client.send(get("/v1/models", method="HEAD"))
        head = await client.reply(head_only=True)
        client.send(get("/v1/models"))
        after = await client.reply()
    assert (head.status, head.headers["content-length"]) == (200, str(len(MODELS)))
    assert head.headers["content-type"] == "application/json"
    assert (after.status, after.body) == (200, MODELS)
    assert methods == ["HEAD", "GET"]


async def test_a_handler_that_raises_gets_500_and_the_server_keeps_serving() -> None:
    """An unexpected exception in a handler: `500` in the OpenAI shape (type `server_error`)
    on `/v1/*`, plain text elsewhere; the server goes on serving new connections."""

    async def boom(request: ServerRequest) -> None:
        raise RuntimeError("boom")

    routes = {"/v1/completions": {"POST": boom}, "/boom": {"GET": boom}} | BASIC
    async with serving(routes) as (_, port):
        async with connect(port) as client:
            client.send(post("/v1/completions", b"{}"))
            openai = await client.reply()
        async with connect(port) as client:
            client.send(get("/boom"))
            plain = await client.reply()
        async with connect(port) as client:
            client.send(get("/v1/models"))
            after = await client.reply()
    error = assert_openai_error(openai, 500, "server_error")
    assert "boom" not in error["message"]  # no internals to the client
    assert (plain.status, plain.headers["content-type"]) == (500, "text/plain")
    assert (after.status, after.body) == (200, MODELS)


# ------------------------------------------------------------------ streams


async def test_a_streamed_answer_is_chunked_event_stream_and_keeps_the_connection() -> None:
    """`start_stream()`, `send()`s and `end()`: a `200` `text/event-stream` answer with
    `Cache-Control: no-cache`, `Transfer-Encoding: chunked` and no `Content-Length`, whose
    chunks decode to exactly what was sent (an empty `send` sends nothing, it would end the
    stream); the connection then serves the next request."""
    events = [b"data: 1\n\n", b"", b'data: {"x": "\\r\\n"}\n\n', b"data: [DONE]\n\n"]

    async def stream(request: ServerRequest) -> None:
        await request.start_stream({})
        for event in events:
            await request.send(event)
        await request.end()
        await request.end()  # a second end is a no-op

    routes = {"/v1/completions": {"POST": stream}} | BASIC
    async with serving(routes) as (_, port), connect(port) as client:
        client.send(post("/v1/completions", b'{"stream": true}'))
        reply = await client.reply()
        client.send(get("/v1/models"))
        after = await client.reply()
    assert reply.status == 200
    assert reply.headers["content-type"] == "text/event-stream"
    assert reply.headers["cache-control"] == "no-cache"
    assert reply.headers["transfer-encoding"] == "chunked"
    assert "connection" not in reply.headers
    assert reply.chunks == [e for e in events if e]
    assert after.body == MODELS


async def test_a_client_that_disconnects_cancels_its_running_handler() -> None:
    """A client that hangs up while its handler is still working (aiohttp's
    `handler_cancellation`): the handler's task is cancelled, and the server forgets the
    connection."""
    flags: list[str] = []

    async def waits(request: ServerRequest) -> None:
        flags.append("started")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            flags.append("cancelled")
            raise

    async with serving({"/v1/completions": {"POST": waits}}) as (server, port):
        async with connect(port) as client:
            client.send(post("/v1/completions", b"{}"))
            await eventually(flagged(flags, "started"), timeout_s=WAIT_S, what="the handler")
        await eventually(flagged(flags, "cancelled"), timeout_s=WAIT_S, what="a cancellation")
        await eventually(lambda: not server.connections, timeout_s=WAIT_S, what="forgotten")


async def test_a_stream_to_a_client_that_does_not_read_waits_then_delivers_every_byte() -> None:
    """Back-pressure: a handler streaming 64 MiB in 64 KiB sends to a client that reads
    nothing is held by `send` once the socket buffers are full (its progress stops, far
    below the total), instead of piling the stream up in memory; once the client reads, it
    gets every byte, in order, and the stream ends."""
    block_size, blocks = 64 * 1024, 1024
    sent = 0
    done = asyncio.Event()

    def block(i: int) -> bytes:
        return bytes([i % 251]) * block_size

    async def flood(request: ServerRequest) -> None:
        nonlocal sent
        await request.start_stream({})
        for i in range(blocks):
            await request.send(block(i))
            sent += 1
        await request.end()
        done.set()

    samples: list[int] = []

    def stalled() -> bool:
        samples.append(sent)
        return sent > 0 and len(samples) >= 6 and len(set(samples[-6:])) == 1

    async with (
        serving({"/v1/completions": {"POST": flood}}) as (_, port),
        connect(port, limit=2**18) as client,
    ):
        client.send(post("/v1/completions", b"{}"))
        await eventually(stalled, timeout_s=5, what="the handler's sends to stop")
        assert sent < blocks // 2, f"{sent} of {blocks} blocks went out to a stalled client"
        assert not done.is_set()
        async with asyncio.timeout(10):
            reply = _parse_head(await client.reader.readuntil(b"\r\n\r\n"))
            assert reply.headers["transfer-encoding"] == "chunked"
            for i in range(blocks):
                assert await client.reader.readuntil(b"\r\n") == b"%x\r\n" % block_size
                data = await client.reader.readexactly(block_size + 2)
                assert data == block(i) + b"\r\n", f"block {i} differs"
            assert await client.reader.readexactly(5) == b"0\r\n\r\n"
            await done.wait()
    assert sent == blocks


@pytest.mark.parametrize("client_sends_the_rest", [True, False], ids=["rest-sent", "stalled"])
async def test_a_handler_that_answers_without_reading_the_body_closes_the_connection(
    client_sends_the_rest: bool,
) -> None:
    """A handler that answers a large POST (2 MiB declared, a first piece sent) without
    reading its body (what the worker's 413 does): the answer arrives at once and says
    `Connection: close`; the server reads and drops the rest of the body, so a client still
    sending can finish and read the answer, then closes: when the body ends, or after
    `linger_s` if the client stops sending."""
    lengths: list[int | None] = []

    async def refuse(request: ServerRequest) -> None:
        lengths.append(request.content_length)
        request.respond(413, b"request body too large", "text/plain")

    declared = 2 * 1024 * 1024  # under the server's own bound (4 MiB)
    routes = {"/upload": {"POST": refuse}}
    async with serving(routes, linger_s=0.2) as (server, port):
        async with connect(port) as client:
            client.send(get("/upload", f"Content-Length: {declared}", method="POST") + b"x" * 4096)
            reply = await client.reply()
            if client_sends_the_rest:
                client.send(b"x" * (declared - 4096))
            assert await client.until_closed() == b""
        await eventually(lambda: not server.connections, timeout_s=WAIT_S, what="forgotten")
    assert (reply.status, reply.body) == (413, b"request body too large")
    assert reply.headers.get("connection") == "close"
    assert lengths == [declared]


# ------------------------------------------------------------------ idle connections


async def test_an_idle_keep_alive_connection_is_closed_after_keepalive_s() -> None:
    """With `keepalive_s=0.2`: a connection idle after its answer is closed about 0.2 s
    later (not at once); one that never sent anything is closed after the head's time
    (`header_timeout_s`, 0.2 s here too) with no answer."""
    limits = Limits(header_timeout_s=0.2)
    async with serving(BASIC, keepalive_s=0.2, limits=limits) as (server, port):
        async with connect(port) as used, connect(port) as unused:
            used.send(get("/v1/models"))
            reply = await used.reply()
            answered = time.monotonic()
            assert await used.until_closed() == b""
            idle_s = time.monotonic() - answered
            assert await unused.until_closed() == b""
        await eventually(lambda: not server.connections, timeout_s=WAIT_S, what="forgotten")
    assert reply.body == MODELS
    assert 0.15 <= idle_s < WAIT_S


async def test_a_connection_that_sends_half_a_head_gets_408_after_header_timeout_s() -> None:
    """A client that starts a head and never finishes it (slowloris) gets 408 and a close
    after `header_timeout_s`: its request never reached a handler."""
    called: list[str] = []

    async def handler(request: ServerRequest) -> None:
        called.append(request.path)
        request.respond(200, b"ok", "text/plain")

    limits = Limits(header_timeout_s=0.2)
    async with serving({"/v1/models": {"GET": handler}}, limits=limits) as (server, port):
        async with connect(port) as client:
            client.send(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Half: ")
            reply = await client.reply()
            assert await client.until_closed() == b""
        await eventually(lambda: not server.connections, timeout_s=WAIT_S, what="forgotten")
    assert_openai_error(reply, 408, "invalid_request_error")
    assert reply.headers["connection"] == "close"
    assert called == []


# ------------------------------------------------------------------ drain and cut-off


async def test_drain_closes_idle_connections_refuses_new_ones_and_lets_a_request_finish() -> None:
    """`drain(grace_s)` with a request in flight and an idle keep-alive connection: the idle
    one is closed at once (while the other is still running), new connections are refused,
    and the running request, released within the grace, gets its whole answer before its
    connection closes; `drain` returns then, not at the end of the grace."""
    flags: list[str] = []
    release = asyncio.Event()

    async def slow(request: ServerRequest) -> None:
        flags.append("started")
        await release.wait()
        request.respond(200, b"finished", "text/plain")

    routes = {"/slow": {"GET": slow}} | BASIC
    async with serving(routes) as (server, port), connect(port) as idle, connect(port) as busy:
        idle.send(get("/v1/models"))
        assert (await idle.reply()).body == MODELS
        busy.send(get("/slow"))
        await eventually(flagged(flags, "started"), timeout_s=WAIT_S, what="the handler")

        start = time.monotonic()
        drain = asyncio.create_task(server.drain(5.0))
        try:
            assert await idle.until_closed() == b""
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(HOST, port)
            assert not drain.done()
            release.set()
            reply = await busy.reply()
            assert await busy.until_closed() == b""
            async with asyncio.timeout(WAIT_S):
                await drain
        finally:
            drain.cancel()
        drained_s = time.monotonic() - start
    assert (reply.status, reply.body) == (200, b"finished")
    assert drained_s < 5.0


async def test_an_answer_sent_during_a_drain_says_connection_close() -> None:
    """A request that finishes while the server drains is answered with `Connection: close`
    (the server closes the connection right after): a keep-alive client told nothing would
    send its next request on a connection being closed under it."""
    flags: list[str] = []
    release = asyncio.Event()

    async def slow(request: ServerRequest) -> None:
        flags.append("started")
        await release.wait()
        request.respond(200, b"finished", "text/plain")

    async with serving({"/slow": {"GET": slow}}) as (server, port), connect(port) as client:
        client.send(get("/slow"))
        await eventually(flagged(flags, "started"), timeout_s=WAIT_S, what="the handler")
        drain = asyncio.create_task(server.drain(5.0))
        try:
            release.set()
            reply = await client.reply()
            assert await client.until_closed() == b""
            async with asyncio.timeout(WAIT_S):
                await drain
        finally:
            drain.cancel()
    assert (reply.status, reply.body) == (200, b"finished")
    assert reply.headers.get("connection", "").lower() == "close", reply.headers


async def test_drain_aborts_a_request_still_running_when_the_grace_runs_out() -> None:
    """`drain(grace_s)` with a request that does not finish: once the grace has passed the
    connection is aborted (the client sees the close with no answer) and the handler's task
    is cancelled."""
    flags: list[str] = []

    async def stuck(request: ServerRequest) -> None:
        flags.append("started")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            flags.append("cancelled")
            raise

    async with serving({"/stuck": {"GET": stuck}}) as (server, port), connect(port) as client:
        client.send(get("/stuck"))
        await eventually(flagged(flags, "started"), timeout_s=WAIT_S, what="the handler")
        start = time.monotonic()
        await server.drain(0.2)
        assert time.monotonic() - start >= 0.2
        assert await client.until_closed() == b""
        await eventually(flagged(flags, "cancelled"), timeout_s=WAIT_S, what="a cancellation")


async def test_drain_delivers_a_finished_answer_larger_than_the_socket_buffers() -> None:
    """The graceful half of a drain is for the client: a request released within the grace
    whose answer (16 MiB) is larger than what the sockets buffer, to a client reading it,
    must reach the client whole, not be cut when the handler returns with the answer still
    in the transport's buffer."""
    size = 16 * 1024 * 1024
    body = bytes(range(256)) * (size // 256)
    flags: list[str] = []
    release = asyncio.Event()

    async def big(request: ServerRequest) -> None:
        flags.append("started")
        await release.wait()
        request.respond(200, body, "application/octet-stream")

    async with serving({"/big": {"GET": big}}) as (server, port), connect(port) as client:
        client.send(get("/big"))
        await eventually(flagged(flags, "started"), timeout_s=WAIT_S, what="the handler")
        drain = asyncio.create_task(server.drain(5.0))
        try:
            release.set()
            async with asyncio.timeout(5):
                head = _parse_head(await client.reader.readuntil(b"\r\n\r\n"))
                assert head.headers["content-length"] == str(size)
                got = 0
                while got < size and (piece := await client.reader.read(2**20)):
                    got += len(piece)
                assert got == size, f"the client got {got} of {size} body bytes, then a close"
                await drain
        finally:
            drain.cancel()


async def test_cut_off_drops_the_connection_at_once() -> None:
    """`cut_off()` in the middle of a stream (a client that stopped reading) drops the
    connection at once: the client gets what was sent before, then the close, without the
    stream's end, while the handler is still running; the handler's task is then cancelled,
    its connection being gone."""
    flags: list[str] = []

    async def stream(request: ServerRequest) -> None:
        await request.start_stream({})
        await request.send(b"data: 1\n\n")
        request.cut_off()
        flags.append("cut")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            flags.append("cancelled")
            raise

    async with serving({"/v1/completions": {"POST": stream}}) as (_, port):
        async with connect(port) as client:
            client.send(post("/v1/completions", b"{}"))
            async with asyncio.timeout(WAIT_S):
                head = _parse_head(await client.reader.readuntil(b"\r\n\r\n"))
            assert head.headers["transfer-encoding"] == "chunked"
            assert await client.until_closed() == b"9\r\ndata: 1\n\n\r\n"
        await eventually(flagged(flags, "cancelled"), timeout_s=WAIT_S, what="a cancellation")
    assert flags == ["cut", "cancelled"]


# ------------------------------------------------------------------ limits, the edges


async def test_a_head_of_many_small_headers_over_64_kib_in_one_read_is_refused() -> None:
    """The head's pieces are summed as the parser hands them over and judged once the head
    is whole: 3,000 short headers (about 75 KiB, every line ended, sent at once) are a head
    over 64 KiB like one long header, refused with `431` before any handler runs."""
    called: list[str] = []

    async def handler(request: ServerRequest) -> None:
        called.append(request.path)
        request.respond(200, b"ok", "text/plain")

    headers = [f"X-H{i}: {'v' * 16}" for i in range(3000)]
    async with serving({"/v1/models": {"GET": handler}}) as (_, port), connect(port) as client:
        client.send(get("/v1/models", *headers))
        reply = await client.reply()
        assert await client.until_closed() == b""
    assert_openai_error(reply, 431, "invalid_request_error")
    assert called == []


async def test_a_head_that_grows_past_64_kib_is_refused_before_it_ends() -> None:
    """A client that sends one header value that never ends (a slowloris with memory):
    once its head is over 64 KiB it is refused with `431` and closed, as any head over
    64 KiB is, without waiting for the line to end (till then the server would buffer it
    without bound for `keepalive_s`)."""
    async with serving(BASIC) as (_, port), connect(port) as client:
        client.send(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * (128 * 1024))
        try:
            reply = await client.reply(timeout_s=1.0)
        except TimeoutError:
            pytest.fail("no answer within 1 s to a 128 KiB head still in progress")
        assert await client.until_closed() == b""
    assert_openai_error(reply, 431, "invalid_request_error")


async def test_a_whole_body_left_unread_does_not_stall_the_connection() -> None:
    """A body that arrived whole (just over the 256 KiB read buffer) while its handler was
    busy, and that the handler answers without reading: after the answer the connection is
    either closed or serves the next request; it must not sit with reading paused, so that
    the client's next request is neither answered nor refused."""
    seen: list[ServerRequest] = []
    release = asyncio.Event()

    async def busy(request: ServerRequest) -> None:
        seen.append(request)
        await release.wait()
        request.respond(200, b"ignored", "text/plain")

    body = b"b" * (256 * 1024 + 1)
    routes = {"/v1/completions": {"POST": busy}} | BASIC
    async with serving(routes) as (_, port), connect(port) as client:
        client.send(post("/v1/completions", body))
        await eventually(
            lambda: bool(seen) and seen[0].body_complete, timeout_s=WAIT_S, what="the body"
        )
        release.set()
        assert (await client.reply()).body == b"ignored"
        client.send(get("/v1/models"))
        try:
            async with asyncio.timeout(1.0):
                rest = await client.reader.read(65536)
        except TimeoutError:
            pytest.fail("the next request on the connection got neither an answer nor a close")
        assert rest == b"" or rest.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_a_body_refused_while_its_handler_is_busy_still_gets_its_413() -> None:
    """A chunked body passes `max_body_bytes` while its handler is busy elsewhere (the
    worker's forward to the control process, under load): what the client sends meanwhile,
    however much, does not use up the drop allowance before the handler answers; reading
    stops instead, and the client gets its 413 when the handler does answer."""
    release = asyncio.Event()

    async def busy(request: ServerRequest) -> None:
        await release.wait()
        await request.read()  # raises: the body was refused

    limit = 64 * 1024
    piece = b"x" * 4096
    chunked = b"%x\r\n%s\r\n" % (len(piece), piece)
    routes = {"/upload": {"POST": busy}}
    limits = Limits(max_body_bytes=limit)
    async with serving(routes, limits=limits) as (server, port), connect(port) as client:
        client.send(get("/upload", "Transfer-Encoding: chunked", method="POST") + chunked * 20)
        await eventually(lambda: len(server.connections) == 1, timeout_s=WAIT_S, what="in")
        [connection] = server.connections
        state = connection.state
        await eventually(lambda: state.discarding, timeout_s=WAIT_S, what="the refusal")
        client.send(chunked * 25)  # 100 KiB more: past the drop allowance
        await eventually(
            lambda: state.closed or state.paused, timeout_s=WAIT_S, what="the rest read"
        )
        release.set()
        reply = await client.reply()
    assert reply.status == 413
    assert orjson.loads(reply.body)["error"]["message"] == f"request body exceeds {limit} bytes"


async def test_a_pipelining_client_that_does_not_read_stops_the_server_serving_it() -> None:
    """64 pipelined requests for 1 MiB answers, none read: once the client's socket and the
    server's buffer are full, the server stops starting handlers and reading (its memory for
    this client stays bounded by one answer); when the client reads, every answer arrives,
    in order."""
    calls: list[int] = []
    answer = b"a" * (1024 * 1024)

    async def big(request: ServerRequest) -> None:
        calls.append(len(calls))
        request.respond(200, answer, "application/octet-stream")

    count = 64
    async with (
        serving({"/big": {"GET": big}}) as (server, port),
        connect(port, limit=2 * len(answer)) as client,
    ):
        client.send(get("/big") * count)

        def stalled() -> bool:
            return any("write" in c._paused_by for c in server.connections)

        await eventually(stalled, timeout_s=WAIT_S, what="the server waiting for the client")
        assert len(calls) < count
        buffered = sum(
            c.transport.get_write_buffer_size() for c in server.connections if c.transport
        )
        assert buffered <= 2 * len(answer)
        for _ in range(count):
            reply = await client.reply()
            assert reply.status == 200 and len(reply.body) == len(answer)
    assert calls == list(range(count))
