"""The floor on a lower-level stack: `bench.floor`'s PD relay on asyncio protocols and httptools.

`python -m bench.uvrun bench.floor_raw --port P --prefill URL --decode URL [--decode URL...]`
(through `bench.uvrun`, which runs it on uvloop and lends it httptools from the bench venv).

Same flags and the same wire work as `bench.floor` — read the body, send the prefill leg with
vLLM's `kv_transfer_params`, parse its JSON, send the decode leg with the handoff spliced in,
relay the answer (bytes, streamed or not) — with no validation, deadlines, placement, evidence
or metrics. Only the stack differs: the server side and the client side are `asyncio.Protocol`s
whose HTTP/1.1 is parsed by httptools (llhttp), and the engines are reached over a small
keep-alive connection pool per engine. It is a measuring device, correct for what the benchmark
sends and no more: requests with Content-Length bodies (keep-alive, pipelining served in
order), engine answers with Content-Length or chunked bodies (narwhal-sim sends JSON with
Content-Length and SSE chunked). A non-streamed answer is relayed whole with Content-Length; a
streamed one is relayed chunked, one chunk per piece the parser hands over, with back-pressure
from the client to the engine connection. An engine that fails mid-request costs that client
a 502 (or a cut stream) and its connection.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
from collections import deque
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

import httptools  # type: ignore[import-not-found,unused-ignore]
import orjson

from narwhal.engine.vllm import PREFILL_KV_PARAMS

_JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
_LAST_CHUNK = b"0\r\n\r\n"
_HEALTH = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
COMPLETIONS = (b"/v1/completions", b"/v1/chat/completions")


def chunk(piece: bytes) -> bytes:
    """One piece of a body in HTTP/1.1 chunked framing."""
    return b"%x\r\n%s\r\n" % (len(piece), piece)


class Upstream(asyncio.Protocol):
    """One keep-alive connection to an engine, one request at a time.

    `send` writes a request and returns a future for the whole body; with `on_head` and `sink`
    the body is not collected: `on_head` is called when the answer's headers are in, `sink`
    with each decoded piece, and the future resolves (to b"") at the end of the answer."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.alive = False
        self.pieces: list[bytes] = []
        self.on_head: Callable[[], None] | None = None
        self.sink: Callable[[bytes], None] | None = None
        self.done: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.alive = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the engine closed the connection"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.done is not None and not self.done.done():
                self.done.set_exception(ConnectionError(f"bad answer from the engine: {exc}"))
            self.close()

    def close(self) -> None:
        self.alive = False
        if self.transport is not None:
            self.transport.close()

    def send(
        self,
        request: bytes,
        on_head: Callable[[], None] | None = None,
        sink: Callable[[bytes], None] | None = None,
    ) -> asyncio.Future[bytes]:
        assert self.transport is not None
        self.done = self.pool.loop.create_future()
        self.on_head, self.sink = on_head, sink
        self.transport.write(request)
        return self.done

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if self.on_head is not None:
            self.on_head()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink(body)
        else:
            self.pieces.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.pieces)
        done = self.done
        self.pieces, self.done, self.on_head, self.sink = [], None, None, None
        if self.parser.should_keep_alive():
            self.pool.idle.append(self)
        else:
            self.close()
        if done is not None and not done.done():
            done.set_result(body)


class Pool:
    """Idle keep-alive connections to one engine; a new one is opened when none is idle."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.loop = loop
        self.idle: list[Upstream] = []
        self.head = (
            b"POST %s HTTP/1.1\r\nHost: " + parts.netloc.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        )

    def request(self, path: bytes, body: bytes) -> bytes:
        return self.head % (path, len(body)) + body

    async def acquire(self) -> Upstream:
        while self.idle:
            conn = self.idle.pop()
            if conn.alive:
                return conn
        _, conn = await self.loop.create_connection(lambda: Upstream(self), self.host, self.port)
        return conn


class Relay:
    """The PD round trip: prefill leg, handoff, decode leg, relay."""

    def __init__(self, prefill: Pool, decode: list[Pool]) -> None:
        self.prefill = prefill
        self.turn = itertools.cycle(decode)

    async def handle(self, client: Server, method: bytes, url: bytes, raw: bytes) -> None:
        path = url.split(b"?", 1)[0]
        if method == b"POST" and path in COMPLETIONS:
            await self.completions(client, path, raw)
        elif method == b"GET" and path == b"/health":
            client.write(_HEALTH)
        else:
            client.write(_NOT_FOUND)

    async def completions(self, client: Server, path: bytes, raw: bytes) -> None:
        body = orjson.loads(raw)
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
        conn = await self.prefill.acquire()
        answer = await conn.send(self.prefill.request(path, orjson.dumps(first)))
        body["kv_transfer_params"] = orjson.loads(answer)["kv_transfer_params"]
        pool = next(self.turn)
        conn = await pool.acquire()
        request = pool.request(path, orjson.dumps(body))
        if not body.get("stream"):
            out = await conn.send(request)
            client.write(_JSON_HEAD % len(out) + out)
            return
        client.upstream = conn
        try:
            await conn.send(
                request,
                on_head=client.start_stream,
                sink=lambda piece: client.write(chunk(piece)),
            )
        finally:
            client.upstream = None
        client.write(_LAST_CHUNK)


class Server(asyncio.Protocol):
    """One client connection: parse requests, serve them one after another, in order."""

    def __init__(self, relay: Relay, loop: asyncio.AbstractEventLoop) -> None:
        self.relay = relay
        self.loop = loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.pieces: list[bytes] = []
        self.queue: deque[tuple[bytes, bytes, bytes, bool]] = deque()
        self.busy = False
        self.upstream: Upstream | None = None  # the engine connection being relayed, if any
        self.streaming = False  # the current answer's head went out as a stream's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.upstream is not None:  # a stream's client is gone: drop its engine connection
            self.upstream.close()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.write(_BAD_REQUEST)
            self.close()

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def start_stream(self) -> None:
        self.streaming = True
        self.write(_SSE_HEAD)

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        p = self.parser
        self.queue.append((p.get_method(), self.url, b"".join(self.pieces), p.should_keep_alive()))
        self.url, self.pieces = b"", []
        if not self.busy:
            self.busy = True
            self.loop.create_task(self.serve())

    async def serve(self) -> None:
        while self.queue and self.transport is not None:
            method, url, body, keep_alive = self.queue.popleft()
            self.streaming = False
            try:
                await self.relay.handle(self, method, url, body)
            except Exception as exc:  # a failed round trip: 502 (unless a stream began), close
                print(f"floor_raw: {type(exc).__name__}: {exc}", file=sys.stderr)
                if not self.streaming:
                    self.write(_BAD_GATEWAY)
                self.close()
            if not keep_alive:
                self.close()
        self.busy = False


async def serve(port: int, prefill: str, decode: list[str]) -> None:
    loop = asyncio.get_running_loop()
    relay = Relay(Pool(prefill, loop), [Pool(u, loop) for u in decode])
    server = await loop.create_server(lambda: Server(relay, loop), "127.0.0.1", port, backlog=128)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    doc: Any = __doc__
    p = argparse.ArgumentParser(prog="python -m bench.floor_raw", description=doc.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True, action="append")
    args = p.parse_args(argv)
    asyncio.run(serve(args.port, args.prefill, args.decode))


if __name__ == "__main__":
    main(sys.argv[1:])
