"""Frames between the control process and a worker: NDJSON over a Unix socket pair.

Each frame is one orjson object (`{"t": kind, ...}`) and a newline; orjson never writes a raw
newline inside. Frames are handled synchronously as their bytes arrive, in order. Sends made
in one loop turn go out in one write at the end of the turn, so a burst of events costs one
system call and still leaves before the process next waits.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

import orjson

from narwhal.process.events import WorkerEvent, encode

log = logging.getLogger("narwhal.channel")

Frame = dict[str, Any]
_MAX_PENDING_BYTES = 64 * 1024 * 1024  # a frame can hold a whole snapshot; nothing near this


class Channel(asyncio.Protocol):
    """One end of a socket pair. `on_frame` gets every frame; `on_lost` once, at EOF or error."""

    def __init__(self, on_frame: Callable[[Frame], None], on_lost: Callable[[], None]) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buffer = b""
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self.closed = False

    @classmethod
    async def open(
        cls, sock: socket.socket, on_frame: Callable[[Frame], None], on_lost: Callable[[], None]
    ) -> Channel:
        loop = asyncio.get_running_loop()
        _, channel = await loop.connect_accepted_socket(lambda: cls(on_frame, on_lost), sock)
        return channel

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            frame = orjson.loads(buffer[start:end])
            start = end + 1
            self._on_frame(frame)
            if self.closed:
                return
        self._buffer = buffer[start:]
        if len(self._buffer) > _MAX_PENDING_BYTES:
            log.error("channel: a frame over %d bytes; closing", _MAX_PENDING_BYTES)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        """A trailing partial frame is dropped: its sender died while writing it."""
        self._lost()

    def eof_received(self) -> bool:
        self._lost()
        return False

    # ---------------------------------------------------------------- sending
    def send(self, kind: str, **fields: Any) -> None:
        if self.closed:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self.flush)
        fields["t"] = kind
        self._out.append(orjson.dumps(fields))

    def send_event(self, event: WorkerEvent) -> None:
        """A worker's typed event (`process/events.py`), in its one encoding."""
        kind, fields = encode(event)
        self.send(kind, **fields)

    def flush(self) -> None:
        if not self._out or self._transport is None or self.closed:
            self._out.clear()
            return
        self._out.append(b"")
        self._transport.write(b"\n".join(self._out))
        self._out.clear()

    def close(self) -> None:
        if self._transport is not None:
            self.flush()
            self._transport.close()
        self._lost()

    def _lost(self) -> None:
        if not self.closed:
            self.closed = True
            self._on_lost()
