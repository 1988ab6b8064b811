"""The tap: a TCP relay in front of engines that records when each one receives traffic.

Run as its own process: `python -m bench.tap`, with one JSON line on stdin,
`{"routes": [[label, backend_port], ...]}`; it listens on a fresh loopback port per label and
answers `{"ports": {label: port}}`. Then each stdin line `dump` answers
`{"marked": {label: [t, ...]}, "marked_ids": {label: [id, ...]}, "health": {label: n}}` (times
on CLOCK_MONOTONIC, shared with the other processes; each marked request's `X-Request-Id`, or
null, in the same order) and forgets them; `quit` or EOF stops it.

A client request counts at an engine when a body carrying the load generator's marker passes
through (probes and health checks do not carry it). When the backend refuses or drops a
connection (a killed engine), the tap resets the client's connection at once, so the router sees
a dead peer, never a half-open one. A frozen backend still accepts (the kernel's backlog), as a
stopped process does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import socket
import struct
import sys
import time
from collections import defaultdict

from bench.loadgen.spec import MARKER

_MARK = MARKER.encode()
_HEALTH = b"GET /health"
_REQUEST_ID = re.compile(rb"\r\nx-request-id: *([\x21-\x7e]+)\r\n", re.IGNORECASE)


class Counts:
    def __init__(self) -> None:
        self.marked: defaultdict[str, list[float]] = defaultdict(list)
        self.ids: defaultdict[str, list[str | None]] = defaultdict(list)
        self.health: defaultdict[str, int] = defaultdict(int)

    def dump(self) -> dict[str, object]:
        doc = {"marked": dict(self.marked), "marked_ids": dict(self.ids),
               "health": dict(self.health)}  # fmt: skip
        self.marked = defaultdict(list)
        self.ids = defaultdict(list)
        self.health = defaultdict(int)
        return doc


def _reset(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Backend(asyncio.Protocol):
    def __init__(self, front: _Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.front.transport is not None:
            self.front.transport.write(data)

    def eof_received(self) -> bool:
        if self.front.transport is not None and not self.front.transport.is_closing():
            self.front.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        front = self.front.transport
        if front is not None and not front.is_closing():
            if exc is not None:
                _reset(front)
            else:
                front.close()

    def pause_writing(self) -> None:
        if self.front.transport is not None:
            self.front.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.front.transport is not None:
            self.front.transport.resume_reading()


class _Front(asyncio.Protocol):
    """The router's side of one relayed connection."""

    def __init__(self, label: str, backend_port: int, counts: Counts) -> None:
        self.label = label
        self.backend_port = backend_port
        self.counts = counts
        self.transport: asyncio.Transport | None = None
        self.backend: _Backend | None = None
        self.pending: list[bytes] = []
        self.tail = b""
        self.request_id: str | None = None  # the last request's, on this connection
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.task = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, backend = await loop.create_connection(
                lambda: _Backend(self), "127.0.0.1", self.backend_port
            )
        except OSError:
            if self.transport is not None:
                _reset(self.transport)
            return
        self.backend = backend
        if self.transport is None or self.transport.is_closing():
            if backend.transport is not None:
                backend.transport.close()
            return
        assert backend.transport is not None
        for data in self.pending:
            backend.transport.write(data)
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        seen = self.tail + data
        found = _REQUEST_ID.search(data)  # a request's head comes before its body
        if found is not None:
            self.request_id = found.group(1).decode()
        if _MARK in seen:
            now = time.monotonic()
            n = seen.count(_MARK)
            self.counts.marked[self.label].extend([now] * n)
            self.counts.ids[self.label].extend([self.request_id] * n)
        if _HEALTH in seen:
            self.counts.health[self.label] += seen.count(_HEALTH)
        self.tail = data[-16:]
        if self.backend is not None and self.backend.transport is not None:
            self.backend.transport.write(data)
        else:
            self.pending.append(data)

    def eof_received(self) -> bool:
        backend = self.backend.transport if self.backend is not None else None
        if backend is not None and not backend.is_closing():
            backend.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.backend is not None and self.backend.transport is not None:
            self.backend.transport.close()

    def pause_writing(self) -> None:
        if self.backend is not None and self.backend.transport is not None:
            self.backend.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.backend is not None and self.backend.transport is not None:
            self.backend.transport.resume_reading()


async def serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    config = json.loads(await reader.readline())
    counts = Counts()
    servers = []
    ports = {}
    for label, backend_port in config["routes"]:
        server = await loop.create_server(
            functools.partial(_Front, label, backend_port, counts), "127.0.0.1", 0, backlog=1024
        )
        servers.append(server)
        ports[label] = server.sockets[0].getsockname()[1]
    print(json.dumps({"ports": ports}), flush=True)
    try:
        while line := (await reader.readline()).strip():
            if line == b"quit":
                break
            print(json.dumps(counts.dump()), flush=True)
    finally:
        for server in servers:
            server.close()


if __name__ == "__main__":
    asyncio.run(serve())
