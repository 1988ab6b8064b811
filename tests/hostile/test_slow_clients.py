"""Slow clients, by hand, against both process modes: a head sent a byte at a time, a body
trickled slower than `serving.client_body_timeout_s`, and a client that never reads its
answer, streamed or not. Each is refused (408, OpenAI-shaped, and a close) or cut off (by the
request's deadline, or by `serving.client_send_timeout_s`), and counted; the legitimate flow
runs through each (conftest's guard)."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import uuid

import orjson
import pytest

from tests.hostile.conftest import SERVING, Hostile
from tests.hostile.metrics import rejected, scrape
from tests.hostile.wire import answers, exchange
from tests.support.poll import eventually

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\n"


async def test_a_head_sent_a_byte_at_a_time_gets_408(hostile: Hostile) -> None:
    """Refused: a byte of head every 0.2 s (each arriving well within any idle timer) still
    gets 408 once the whole head has taken `client_header_timeout_s`, then a close."""
    before = await asyncio.to_thread(rejected, hostile.url, "header_timeout")
    head = HEAD + b"X-Slow: " + b"a" * 40
    started = time.monotonic()
    data, closed = await exchange(hostile.port, [bytes([b]) for b in head], pause_s=0.2)
    took_s = time.monotonic() - started
    [answer] = answers(data)
    assert answer.status == 408 and answer.error()["code"] == 408
    assert closed
    assert SERVING["client_header_timeout_s"] <= took_s < len(head) * 0.2
    await eventually(
        lambda: asyncio.to_thread(rejected, hostile.url, "header_timeout"),
        what="the 408 counted",
    )
    assert await asyncio.to_thread(rejected, hostile.url, "header_timeout") > before


async def test_a_body_trickled_slower_than_the_body_timeout_gets_408(hostile: Hostile) -> None:
    """Refused: a byte of body every 1.5 s (past `client_body_timeout_s` of 1 s) gets 408
    and a close; the tap engines never see the request."""
    nonce = uuid.uuid4().hex
    body = orjson.dumps({"model": "tap-model", "prompt": f"trickle {nonce}", "max_tokens": 2})
    head = HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    before = await asyncio.to_thread(rejected, hostile.url, "body_timeout")
    data, closed = await exchange(hostile.port, [head, *[body[i : i + 1] for i in range(4)]],
                                  pause_s=1.5)  # fmt: skip
    [answer] = answers(data)
    assert answer.status == 408 and answer.error()["code"] == 408
    assert answer.headers["x-request-id"]
    assert closed
    assert hostile.tap.entries(nonce) == ([], [])
    assert await asyncio.to_thread(rejected, hostile.url, "body_timeout") > before


def _drained(
    sock: socket.socket, timeout_s: float, head: bytearray | None = None
) -> tuple[int, bool]:
    """Read what the router sent until the connection ends: (bytes, ended in time); the
    first 4 KiB are kept in `head` when given."""
    sock.setblocking(True)
    sock.settimeout(timeout_s)
    total = 0
    try:
        while piece := sock.recv(1 << 16):
            if head is not None and len(head) < 4096:
                head += piece[: 4096 - len(head)]
            total += len(piece)
    except ConnectionResetError:
        return total, True
    except TimeoutError:
        return total, False
    return total, True


async def _ask_without_reading(port: int, body: bytes) -> socket.socket:
    """A completion sent on a socket with a tiny receive window, which the caller never
    reads (until it drains what came, at the end)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    head = HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, head + body)
    except BaseException:
        sock.close()
        raise
    return sock


@pytest.mark.slow
async def test_a_client_that_never_reads_its_answer_is_cut_off(hostile: Hostile) -> None:
    """Handled once, then cut off: a stream of 60,000 tokens (about 9 MB) asked on a socket
    with a tiny receive window that is not read. The tap's engines saw the request once; the
    router counts it as `outcome="deadline"` by `serving.request_timeout_s` and drops the
    client, who then reads only what was already on its way, not the whole answer."""
    nonce = uuid.uuid4().hex
    body = orjson.dumps(
        {"model": "tap-model", "prompt": f"never read {nonce}", "max_tokens": 60000,
         "stream": True}
    )  # fmt: skip
    before = await asyncio.to_thread(scrape, hostile.url, "narwhal_requests_total",
                                     outcome="deadline")  # fmt: skip
    sock = await _ask_without_reading(hostile.port, body)
    try:

        async def cut_off() -> bool:
            now = await asyncio.to_thread(
                scrape, hostile.url, "narwhal_requests_total", outcome="deadline"
            )
            return now > before

        await eventually(
            cut_off,
            timeout_s=float(SERVING["request_timeout_s"]) + 15,
            interval_s=0.2,
            what="the router to give up on a client that never reads",
        )
        total, ended = await asyncio.to_thread(_drained, sock, 10.0)
    finally:
        sock.close()
    assert ended, "the connection was not closed"
    assert total < 8 * 2**20, f"the whole answer came ({total} bytes)"
    prefill, decode = hostile.tap.entries(nonce)
    assert len(prefill) == 1 and len(decode) == 1


@pytest.mark.slow
async def test_a_client_that_never_reads_an_unstreamed_answer_is_aborted(hostile: Hostile) -> None:
    """An answer of 600,000 tokens with their ids (8.5 MB: more than the kernel's socket
    buffers take), not streamed, asked on a socket with a tiny receive window that is not
    read: the router's handler is done once it has written the answer, but the answer cannot
    leave. After `client_send_timeout_s` with nothing taken the connection is aborted and
    counted `send_timeout` (a close would wait to send it for good, holding the answer and a
    connection slot); the engines saw the request once."""
    nonce = uuid.uuid4().hex
    body = orjson.dumps({"model": "tap-model", "prompt": f"unread {nonce}", "max_tokens": 600000,
                         "return_token_ids": True})  # fmt: skip
    before = await asyncio.to_thread(rejected, hostile.url, "send_timeout")
    started = time.monotonic()
    sock = await _ask_without_reading(hostile.port, body)
    try:

        async def aborted() -> bool:
            return await asyncio.to_thread(rejected, hostile.url, "send_timeout") > before

        await eventually(
            aborted,
            # The engine writes 8.5 MB first: 17-19 s in all on a quiet 2-core host, past
            # 28 s on a loaded one (the clean-clone run of 2026-12-07 11:26, both modes),
            # once past 58 s (14:13 the same day, workers).
            timeout_s=float(SERVING["client_send_timeout_s"]) + 100,
            interval_s=0.2,
            what="the router to abort a client that never reads its answer",
        )
        took_s = time.monotonic() - started
        head = bytearray()
        total, ended = await asyncio.to_thread(_drained, sock, 10.0, head)
    finally:
        sock.close()
    assert took_s >= SERVING["client_send_timeout_s"]
    assert ended, "the connection was not closed"
    assert head.startswith(b"HTTP/1.1 200 "), bytes(head[:200])
    length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
    assert length > 4 * 2**20  # more than the sockets between us hold
    assert total < length, f"the whole answer came ({total} bytes)"
    prefill, decode = hostile.tap.entries(nonce)
    assert len(prefill) == 1 and len(decode) == 1
