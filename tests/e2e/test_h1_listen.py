"""The client server's listening sockets (`process/h1_listen.py`), on uvloop as the workers
run: every connection the kernel has queued is taken at the next readiness, where uvloop's
own server takes one a loop iteration (a saturated worker then left a burst of new clients'
first requests unread for seconds); a port in use fails the bind; `close` stops accepting."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import uvloop

from narwhal.process.h1_listen import Listener, bind

BURST = 200


class Counting(asyncio.Protocol):
    made = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        Counting.made += 1


def _connect(port: int, n: int) -> list[socket.socket]:
    """`n` connections whose handshakes the kernel completes before anyone accepts them."""
    clients = []
    for _ in range(n):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        clients.append(c)
    return clients


async def _made_per_iteration(start_server: str) -> list[int]:
    loop = asyncio.get_running_loop()
    Counting.made = 0
    if start_server == "uvloop":
        server = await loop.create_server(Counting, "127.0.0.1", 0, backlog=4096)
        port = server.sockets[0].getsockname()[1]
    else:
        listener = Listener(loop, await bind(loop, "127.0.0.1", 0, 4096, False), Counting, 4096)
        port = listener.sockets[0].getsockname()[1]
    clients = _connect(port, BURST)
    seen = []
    for _ in range(10):
        await asyncio.sleep(0)  # one loop iteration
        seen.append(Counting.made)
    for c in clients:
        c.close()
    if start_server == "uvloop":
        server.close()
    else:
        listener.close()
    return seen


def test_a_burst_is_accepted_whole_where_uvloops_server_takes_one_an_iteration() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        theirs = runner.run(_made_per_iteration("uvloop"))
        ours = runner.run(_made_per_iteration("listener"))
    assert theirs[-1] < BURST // 4, theirs  # what this module exists for: still true?
    assert ours[-1] == BURST and ours.index(BURST) <= 3, ours


async def test_a_port_in_use_fails_the_bind_and_close_stops_accepting() -> None:
    loop = asyncio.get_running_loop()
    sockets = await bind(loop, "127.0.0.1", 0, 16, False)
    port = sockets[0].getsockname()[1]
    with pytest.raises(OSError):
        await bind(loop, "127.0.0.1", port, 16, False)
    listener = Listener(loop, sockets, Counting, 16)
    listener.close()
    listener.close()  # again: nothing
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
