"""Floods, against both process modes: bodies past `serving.max_body_bytes` on every path
before any key, more connections than `serving.max_client_connections`, and pipelining."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid

import orjson
import pytest

from tests.hostile.conftest import MAX_CONNECTIONS, SERVING, TOKEN, Hostile
from tests.hostile.metrics import rejected
from tests.hostile.wire import answers, exchange
from tests.support.poll import eventually

GIB = 1 << 30


CREDENTIALS = {
    "/v1/completions": "Authorization: Bearer sk-hostile\r\n",
    "/tokenize": "Authorization: Bearer sk-hostile\r\n",
    "/admin/x": f"Authorization: Bearer {TOKEN}\r\n",
    "/no/such/path": "",
}


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "no-key"])
@pytest.mark.parametrize("path", list(CREDENTIALS))
async def test_a_chunked_gigabyte_is_refused_on_every_path(
    hostile: Hostile, path: str, keyed: bool
) -> None:
    """Refused: a chunked body of up to 1 GiB gets 413 once it passes `max_body_bytes`, and
    the router closes after taking at most a few MiB more; nothing of it is kept (the guard
    checks RSS). With its key right only the size can refuse it; with no key it is 413 all
    the same, not 401 (DESIGN §12: the size before the key, chunked or not)."""
    before = await asyncio.to_thread(rejected, hostile.url, "body_too_large")
    reader, writer = await asyncio.open_connection("127.0.0.1", hostile.port)
    chunk = b"x" * 65536
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    sent = 0
    received = b""

    async def read_all() -> None:
        nonlocal received
        with contextlib.suppress(ConnectionError):
            while piece := await reader.read(65536):
                received += piece

    reading = asyncio.create_task(read_all())
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\n{CREDENTIALS[path] if keyed else ''}"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        async with asyncio.timeout(30):
            with contextlib.suppress(ConnectionError):
                while sent < GIB and not reading.done():
                    writer.write(framed)
                    await writer.drain()
                    await asyncio.sleep(0)  # let the reader take the answer as it comes
                    sent += len(chunk)
            await reading
    finally:
        writer.transport.abort()
        reading.cancel()
    assert sent < 64 * 2**20, f"the router took {sent} bytes"
    [answer] = answers(received)
    assert answer.status == 413 and answer.error()["code"] == 413
    assert answer.headers["connection"] == "close"
    assert await asyncio.to_thread(rejected, hostile.url, "body_too_large") > before


@pytest.mark.parametrize("path", list(CREDENTIALS))
async def test_a_declared_gigabyte_is_refused_before_auth(hostile: Hostile, path: str) -> None:
    """Refused before auth: `Content-Length: 1 GiB` with no key and `Expect: 100-continue`
    gets 413 at once on every path (not 401, not 404), never a `100 Continue`."""
    data, closed = await exchange(
        hostile.port,
        f"POST {path} HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        f"Content-Length: {GIB}\r\n\r\n".encode(),
    )
    assert [a.status for a in answers(data)] == [413], data
    assert closed


@pytest.mark.slow
async def test_connections_past_the_bound_are_refused_and_counted(hostile: Hostile) -> None:
    """Refused past the bound: 2,200 clients each make one request and then sit idle in
    keep-alive, against `max_client_connections` 1,000. At most the bound's worth are
    served (the flow holds some), every other one is closed on accept with nothing read or
    written, and each is counted as `connections` (but one the router closed as idle: its
    client wrote nothing within the head's timeout); the flow's open connections keep
    working, and once the crowd leaves a new client is served."""
    before = await asyncio.to_thread(rejected, hostile.url, "connections")
    crowd = 2200
    held: list[asyncio.StreamWriter] = []
    served = refused = late = 0

    async def one() -> None:
        nonlocal served, refused, late
        started = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", hostile.port)
        except OSError:
            refused += 1
            return
        held.append(writer)
        # This process resumes 2,200 connects one after another: on a loaded machine one may
        # write its request more than the head's timeout after the router accepted it, and
        # the router rightly closes a connection that said nothing by then, as an idle one
        # (`h1_state`), not as one past the bound.
        wrote_late = time.monotonic() - started > SERVING["client_header_timeout_s"]
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(20):
                head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            served += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            refused += 1
            late += wrote_late

    started = time.monotonic()
    try:
        await asyncio.gather(*(one() for _ in range(crowd)))
        took_s = time.monotonic() - started
        print(f"{hostile.mode}: {served} served, {refused} refused ({late} late) in {took_s:.1f} s")
        assert served + refused == crowd
        assert served <= MAX_CONNECTIONS
        assert refused >= crowd - MAX_CONNECTIONS
        hostile.peak_rss_bytes = max(hostile.peak_rss_bytes, hostile.router.rss_bytes())
    finally:
        for writer in held:
            writer.close()

    seen: list[object] = []  # what the last probe saw, for the failure's message

    async def counted() -> bool:
        try:
            now = await asyncio.to_thread(rejected, hostile.url, "connections")
        except OSError as exc:
            seen[:] = [exc]
            return False
        seen[:] = [now - before]
        return now - before >= refused - late

    try:
        await eventually(counted, timeout_s=20, what="the refusals counted, a client served again")
    except AssertionError as exc:
        message = f"{refused} refused ({late} written late), {served} served, saw {seen}"
        raise AssertionError(f"{exc}: {message}") from None


async def test_a_pipelining_flood_is_answered_once_each_in_order(hostile: Hostile) -> None:
    """Handled exactly once each: 2,000 pipelined GET /health in one write get 2,000 answers
    in order; 50 pipelined completions to the tap reach its engines once each, in order."""
    data, _ = await exchange(
        hostile.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 2000, enough=2000, wait_s=30
    )
    got = answers(data)
    assert [a.status for a in got] == [200] * 2000

    nonce = uuid.uuid4().hex
    prompts = [f"pipelined {i} {nonce}" for i in range(50)]
    wire = b""
    for prompt in prompts:
        body = orjson.dumps({"model": "tap-model", "prompt": prompt, "max_tokens": 2})
        wire += (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
    data, _ = await exchange(hostile.port, wire, enough=len(prompts), wait_s=30)
    assert [a.status for a in answers(data)] == [200] * len(prompts)
    prefill, decode = hostile.tap.entries(nonce)
    assert [e["body"]["prompt"] for e in prefill] == prompts
    assert [e["body"]["prompt"] for e in decode] == prompts


async def test_a_pipelining_flood_never_read_stays_bounded(hostile: Hostile) -> None:
    """Handled up to what the client takes: 100,000 pipelined requests (3.4 MB) on a socket
    never read. A router that stops reading once its answers are not taken holds 16 queued
    requests and one read's worth, so its memory, once settled, stays within 32 MiB of
    before (the guard bounds the total too)."""
    before = hostile.router.rss_bytes()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # answers are not taken
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", hostile.port))
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(5):  # the client's own patience: it then gives up
                await loop.sock_sendall(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 100_000)
        samples: list[int] = []

        def settled() -> bool:  # the router's memory stopped moving
            samples.append(hostile.router.rss_bytes())
            return len(samples) > 2 and abs(samples[-1] - samples[-3]) < 2**20

        await eventually(settled, timeout_s=20, interval_s=0.25, what="the router's RSS settled")
        grown = samples[-1] - before
        print(f"{hostile.mode}: RSS grew {grown / 2**20:.1f} MiB under an unread flood")
        assert grown < 32 * 2**20
    finally:
        sock.close()
