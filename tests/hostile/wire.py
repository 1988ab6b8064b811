"""Raw bytes to the router and what comes back, read as a strict client would.

`exchange` sends bytes on a fresh connection and reads until the router closes (a reset
after its answer counts as a close); `answers` parses what came back into responses with
httptools' response parser, so a second answer or stray bytes after the first are seen.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import httptools
import orjson

WAIT_S = 8.0  # a case's answer and close must come within this


@dataclass
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def error(self) -> dict[str, object]:
        """The OpenAI-shaped error this answer carries."""
        assert self.headers.get("content-type") == "application/json", self
        error = orjson.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return dict(error)


class _Collector:
    def __init__(self) -> None:
        self.done: list[Response] = []
        self.current: Response | None = None
        self.parser: httptools.HttpResponseParser | None = None

    def on_message_begin(self) -> None:
        self.current = Response(0)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self.current is not None and self.parser is not None
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.body += body

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.done.append(self.current)
        self.current = None


def answers(data: bytes) -> list[Response]:
    """Every whole response in `data`, in order (interim 1xx answers included); bytes that
    do not parse as responses, or a response cut short, fail the test."""
    collector = _Collector()
    parser = httptools.HttpResponseParser(collector)
    collector.parser = parser
    parser.feed_data(data)
    assert collector.current is None, f"a response cut short: {data[-300:]!r}"
    return collector.done


async def exchange(
    port: int,
    chunks: list[bytes] | bytes,
    *,
    pause_s: float = 0.0,
    half_close: bool = False,
    wait_s: float = WAIT_S,
    enough: int | None = None,
) -> tuple[bytes, bool]:
    """Send `chunks` on a fresh connection (`pause_s` apart: the client's own pacing), then
    read until the router closes, or (`enough`) until that many final answers are in.
    Returns what was read, and whether the router closed in time."""
    if isinstance(chunks, bytes):
        chunks = [chunks]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()

    async def read() -> bool:
        """Until the close (True), or `enough` answers (False: the connection stays)."""
        with contextlib.suppress(ConnectionError):
            while piece := await reader.read(65536):
                received.extend(piece)
                if enough is not None and _finals(bytes(received)) >= enough:
                    return False
        return True

    reading = asyncio.create_task(read())
    try:
        for i, chunk in enumerate(chunks):
            if i and pause_s:
                await asyncio.sleep(pause_s)  # the client's pacing, not a wait for state
            if reading.done():
                break  # the router closed: the client stops sending
            try:
                writer.write(chunk)
                await writer.drain()
            except ConnectionError:
                break
        if half_close and not reading.done():
            with contextlib.suppress(ConnectionError, OSError):
                writer.write_eof()
        try:
            async with asyncio.timeout(wait_s):
                closed = await reading
        except TimeoutError:
            closed = False
    finally:
        reading.cancel()
        writer.transport.abort()
    return bytes(received), closed


def _finals(data: bytes) -> int:
    collector = _Collector()
    parser = httptools.HttpResponseParser(collector)
    collector.parser = parser
    with contextlib.suppress(httptools.HttpParserError):
        parser.feed_data(data)
    return sum(1 for r in collector.done if r.status >= 200)
