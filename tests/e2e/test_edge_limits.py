"""The edge's limits (DESIGN §12, docs/edge.md#limits) on a real router, over raw sockets.

Each runs in the process mode the suite runs (`NARWHAL_TEST_WORKERS`: workers by default, one
process with `make pytest-single`): a slow head and a trickled body get 408; a chunked body
past `serving.max_body_bytes` gets 413 on `/v1`, on `/admin` and on an unknown path; a client
that waits for `100 Continue` gets its 401 or 413 instead, never the go; connections past
`serving.max_client_connections` are closed on accept. Every refusal is OpenAI-shaped, closes
the connection and is counted in `narwhal_client_rejected_total{reason}`. The engines are
closed ports: nothing here reaches one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.http import metric
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter

OFFLINE = [
    {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:7", "role": "decode"},
]
TOKEN = "s3cret-admin-token"
LIMIT = 4096
WAIT_S = 5.0
SERVING = {
    "client_header_timeout_s": 0.5,
    "client_body_timeout_s": 0.5,
    "max_body_bytes": LIMIT,
}


@pytest.fixture
async def rr(start_router: StartRouter, monkeypatch: pytest.MonkeyPatch) -> RunningRouter:
    monkeypatch.setenv("TEST_EDGE_KEYS", "sk-good")
    return await start_router(
        OFFLINE,
        admin={"token": TOKEN},
        auth={"api_keys_env": "TEST_EDGE_KEYS"},
        serving=SERVING,
    )


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def answer_then_close(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The one answer the server sends before it closes: status, headers, body; the read
    must end (a close, or a reset after it) within WAIT_S."""
    data = b""
    async with asyncio.timeout(WAIT_S):
        with contextlib.suppress(ConnectionResetError):
            while piece := await reader.read(65536):
                data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    assert len(body) == int(headers["content-length"]), data  # one answer, nothing after
    return int(line.split(" ")[1]), headers, body


def openai_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> Any:
    assert status == expected, body
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] in (expected, "invalid_api_key")
    return error


async def rejected(http: aiohttp.ClientSession, rr: RunningRouter, reason: str) -> float:
    return await metric(http, rr.url, "narwhal_client_rejected_total", reason=reason)


async def test_a_head_not_whole_in_time_gets_408_and_a_close(
    rr: RunningRouter, http: aiohttp.ClientSession
) -> None:
    """A head sent by halves that never ends (slowloris): 408 at client_header_timeout_s
    after the accept, though bytes kept coming."""
    before = await rejected(http, rr, "header_timeout")
    async with connect(rr.url) as (reader, writer):
        started = time.monotonic()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        writer.write(b"X-Slow: a\r\n")
        status, headers, body = await answer_then_close(reader)
        took_s = time.monotonic() - started
    error = openai_error(status, headers, body, 408)
    assert "head" in error["message"]
    assert 0.4 <= took_s < WAIT_S
    await eventually(
        lambda: _more(http, rr, "header_timeout", before), what="the 408 counted", timeout_s=5
    )


async def test_a_trickled_body_gets_408_and_a_close(
    rr: RunningRouter, http: aiohttp.ClientSession
) -> None:
    """A body that stops arriving for longer than client_body_timeout_s: the data plane
    answers 408 (with its request id) and the connection closes."""
    before = await rejected(http, rr, "body_timeout")
    async with connect(rr.url) as (reader, writer):
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-good\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
        )
        status, headers, body = await answer_then_close(reader)
    error = openai_error(status, headers, body, 408)
    assert "body" in error["message"]
    assert headers["x-request-id"]
    await eventually(
        lambda: _more(http, rr, "body_timeout", before), what="the 408 counted", timeout_s=5
    )


@pytest.mark.parametrize(
    "path",
    ["/v1/completions", "/admin/engines/p0/drain", "/no/such/path"],
    ids=["v1", "admin", "unknown"],
)
async def test_a_chunked_body_past_max_body_bytes_gets_413_on_every_path(
    rr: RunningRouter, http: aiohttp.ClientSession, path: str
) -> None:
    """Chunks that add up past max_body_bytes (no length declared): 413 and a close, whether
    the path is the client API's, the admin API's (its token given) or nobody's; nothing past
    the bound is buffered (the rest is dropped, then the connection closes)."""
    before = await rejected(http, rr, "body_too_large")
    chunk = b"x" * 1024
    async with connect(rr.url) as (reader, writer):
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{TOKEN if path.startswith('/admin') else 'sk-good'}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        for _ in range(LIMIT // len(chunk) + 2):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, headers, body = await answer_then_close(reader)
    error = openai_error(status, headers, body, 413)
    assert str(LIMIT) in error["message"]
    await eventually(
        lambda: _more(http, rr, "body_too_large", before), what="the 413 counted", timeout_s=5
    )


async def test_a_declared_body_past_max_body_bytes_gets_413_without_100_continue(
    rr: RunningRouter,
) -> None:
    """A client that declares too large a body and waits for the go: 413 first, even with a
    wrong key (the size is checked before the key), and never a 100 Continue."""
    async with connect(rr.url) as (reader, writer):
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-bad\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1)
        )
        status, headers, body = await answer_then_close(reader)
    openai_error(status, headers, body, 413)


@pytest.mark.parametrize("path", ["/v1/completions", "/admin/engines/p0/drain"])
async def test_100_continue_only_once_the_key_is_accepted(rr: RunningRouter, path: str) -> None:
    """With a wrong key (the client key on /v1, the admin token on /admin) the client that
    waits for the go gets its 401 and a close instead; with the right one it gets
    `100 Continue` before it sends the body, then its answer."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Expect: 100-continue\r\nContent-Length: 2\r\n"
    )
    async with connect(rr.url) as (reader, writer):
        writer.write(f"{head}Authorization: Bearer wrong\r\n\r\n".encode())
        status, headers, body = await answer_then_close(reader)
    assert status == 401, body
    assert headers["connection"] == "close"
    good = TOKEN if path.startswith("/admin") else "sk-good"
    async with connect(rr.url) as (reader, writer):
        writer.write(f"{head}Authorization: Bearer {good}\r\n\r\n".encode())
        async with asyncio.timeout(WAIT_S):
            interim = await reader.readuntil(b"\r\n\r\n")
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"{}")
        async with asyncio.timeout(WAIT_S):
            final = await reader.readuntil(b"\r\n\r\n")
    assert not final.startswith(b"HTTP/1.1 100"), final
    assert not final.startswith(b"HTTP/1.1 401"), final


async def test_connections_past_the_routers_bound_are_closed_on_accept(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """max_client_connections bounds the router (all workers together): with the bound's
    worth of connections open and served, the next one is closed with no answer and counted;
    once one closes, a new one is served again, and the gauge counts what is open."""
    bound = 4
    rr = await start_router(OFFLINE, serving={"max_client_connections": bound})
    async with contextlib.AsyncExitStack() as stack:
        held = [await stack.enter_async_context(connect(rr.url)) for _ in range(bound)]
        for reader, writer in held:  # each accepted and served, so counted
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(WAIT_S):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                await reader.readexactly(2)  # "ok"
        async with connect(rr.url) as (reader, writer):
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(WAIT_S):
                try:
                    refused = await reader.read(65536)
                except ConnectionResetError:
                    refused = b""
        assert refused == b""
        reader, writer = held.pop()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

        async def served_again() -> bool:
            try:
                refusals = await rejected(http, rr, "connections")
                connections = await metric(http, rr.url, "narwhal_client_connections")
            except aiohttp.ClientError:
                return False
            # The bound's worth: the ones held, and this scrape's.
            return refusals >= 1 and connections == bound

        await eventually(served_again, what="a connection served again, the refusal counted")


async def _more(http: aiohttp.ClientSession, rr: RunningRouter, reason: str, than: float) -> bool:
    return await rejected(http, rr, reason) > than
