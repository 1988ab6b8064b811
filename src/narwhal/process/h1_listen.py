"""The client server's listening sockets, accepting every queued connection at once.

Why not `loop.create_server`: on uvloop (the workers' loop) a server whose loop is saturated
by the connections it already has accepts new ones only slowly, while the kernel has long
completed their handshakes: the clients send their first request at once, and it waits in a
socket nobody reads. Measured with wrk at c=256 against one process at full load
(docs/performance-log.md, "New connections starved on uvloop"): the connections of a burst
were taken up over 5 s, their first requests answered up to 3 s late, while every request of
an accepted connection was answered within 0.25 s. Here each listening socket is a plain
reader: when it is readable, everything queued is accepted (up to the backlog) before the
loop does anything else, as asyncio's own selector loop does, and each connection gets its
transport from `loop.connect_accepted_socket` (TLS included, its handshake bounded by
`handshake_timeout_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from ssl import SSLContext

log = logging.getLogger("narwhal.server")

# Accepting fails for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): wait
# this long before trying again, as asyncio does, rather than spin on a readable socket.
ACCEPT_RETRY_S = 1.0


async def bind(
    loop: asyncio.AbstractEventLoop, host: str, port: int, backlog: int, reuse_port: bool
) -> list[socket.socket]:
    """A listening, non-blocking socket for each address `host` resolves to (as
    `create_server` binds them); OSError when one cannot be bound (the port in use)."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Listener:
    """Accepts on `sockets` until `close`; each connection's protocol comes from
    `factory`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sockets: list[socket.socket],
        factory: Callable[[], asyncio.Protocol],
        backlog: int,
        ssl: SSLContext | None = None,
        handshake_timeout_s: float | None = None,
    ) -> None:
        self._loop = loop
        self.sockets = sockets
        self._factory = factory
        self._backlog = backlog
        self._ssl = ssl
        self._handshake_timeout_s = handshake_timeout_s
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False
        for sock in sockets:
            loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(self._backlog):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as exc:
                log.error("accepting a client connection failed: %s; retrying in 1 s", exc)
                self._loop.remove_reader(listener.fileno())
                self._loop.call_later(ACCEPT_RETRY_S, self._resume, listener)
                return
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._start(conn))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    def _resume(self, listener: socket.socket) -> None:
        if not self._closed:
            self._loop.add_reader(listener.fileno(), self._accept, listener)

    async def _start(self, conn: socket.socket) -> None:
        """The connection's transport and protocol (the protocol's `connection_made` runs
        once a TLS handshake, if any, is done); a handshake that fails or times out, or a
        client already gone, closes it, as the loop's own server does."""
        try:
            await self._loop.connect_accepted_socket(
                self._factory,
                conn,
                ssl=self._ssl,
                ssl_handshake_timeout=self._handshake_timeout_s if self._ssl else None,
            )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            log.debug("client connection closed before it started: %s", exc)
            conn.close()

    def close(self) -> None:
        """Stop accepting and close the listening sockets (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        for sock in self.sockets:
            with contextlib.suppress(ValueError, OSError):  # already removed, or closed
                self._loop.remove_reader(sock.fileno())
            sock.close()
        # Handshakes under way finish on their own (bounded): their connections, arriving
        # while the server drains, are closed at once (`ServerConnection.connection_made`).
