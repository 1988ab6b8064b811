"""`serving.client_send_timeout_s` in the HTTP/1 server's shell, on a real socket: a client
whose socket stays full, taking nothing of an answer for the timeout, is aborted and counted
`send_timeout`; one that takes some within each period is not."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from narwhal.process.h1_request import ServerRequest
from narwhal.process.h1_server import H1Server
from narwhal.process.h1_state import Limits
from tests.support.poll import eventually

ANSWER = b"x" * 16_000_000  # far more than the kernel's socket buffers hold
SEND_TIMEOUT_S = 1.0


async def _big(request: ServerRequest) -> None:
    request.respond(200, ANSWER, "application/octet-stream")


@pytest.fixture
async def server() -> AsyncIterator[tuple[H1Server, list[str]]]:
    rejected: list[str] = []
    limits = Limits(send_timeout_s=SEND_TIMEOUT_S)
    h1 = H1Server({"/big": {"GET": _big}}, _big, limits=limits, on_reject=rejected.append)
    await h1.start("127.0.0.1", 0, reuse_port=False)
    try:
        yield h1, rejected
    finally:
        await h1.drain(0.1)


async def _ask(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock


async def test_a_client_that_takes_nothing_is_aborted_and_counted(
    server: tuple[H1Server, list[str]],
) -> None:
    h1, rejected = server
    sock = await _ask(h1.port)
    try:
        await eventually(lambda: rejected == ["send_timeout"], timeout_s=10, what="the abort")
        await eventually(lambda: not h1.connections, timeout_s=5, what="the connection gone")
    finally:
        sock.close()


async def test_a_slow_reader_that_takes_some_every_period_is_served_on(
    server: tuple[H1Server, list[str]],
) -> None:
    """Reading what has arrived every tenth of the timeout for two timeouts: never aborted
    (each period saw progress, though the router's own buffer may not have moved); then it
    stops reading, and is."""
    h1, rejected = server
    sock = await _ask(h1.port)
    loop = asyncio.get_running_loop()
    try:
        for _ in range(20):
            await asyncio.sleep(SEND_TIMEOUT_S / 10)  # the client's pace, not a wait for a state
            await loop.sock_recv(sock, 1 << 16)
        assert rejected == []
        assert h1.connections
        await eventually(lambda: rejected == ["send_timeout"], timeout_s=10, what="the abort")
    finally:
        sock.close()
