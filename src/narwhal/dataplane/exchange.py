"""The client side of one request, whatever serves HTTP: the seam between the data plane and
the server (DESIGN §9; docs/design/raw-server.md).

`DataPlane.handle` reads the client's body and, for a stream, writes it through an
`Exchange`, and returns a `Result`: an `Answer` the server sends once `handle` returns (after
the request's evidence has settled), or `Streamed` when the answer already went out as a
stream. `AiohttpExchange` is the aiohttp server's side of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from narwhal.dataplane.record import RequestRecord

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer, sent by the server after `DataPlane.handle` returns."""

    status: int
    body: bytes
    content_type: str
    outcome: str = "ok"
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Streamed:
    """The answer went out as a stream through the exchange (ended, or cut off)."""

    outcome: str


Result = Answer | Streamed


class Exchange(Protocol):
    """One client request and its streamed answer."""

    # The outcome of a stream whose `[DONE]` reached the client: whatever happens after (the
    # client leaving before the response is finalised), the request was served.
    settled_outcome: str | None
    # What the data plane learns about the request as it runs (its id, engines, timings).
    record: RequestRecord | None

    @property
    def content_length(self) -> int | None: ...

    def header(self, name: str) -> str | None:
        """A request header (`name` in lower case), or None."""
        ...

    async def read_some(self) -> bytes:
        """The next piece of the body; b"" at its end."""
        ...

    async def start_stream(self, headers: Mapping[str, str]) -> None:
        """Send the head of a 200 `text/event-stream` answer, with `headers` too."""
        ...

    async def send(self, data: bytes) -> None:
        """Write and wait for the client to take it (back-pressure); `ConnectionResetError`
        when the client is gone."""
        ...

    async def end(self) -> None:
        """End the stream."""
        ...

    def cut_off(self) -> None:
        """Drop the client's connection at once (a client that stopped reading)."""
        ...


class AiohttpExchange:
    """An `Exchange` over an aiohttp request; `response` is what the handler returns."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._stream: web.StreamResponse | None = None
        self.settled_outcome: str | None = None
        self.record: RequestRecord | None = None

    @property
    def content_length(self) -> int | None:
        return self._request.content_length

    def header(self, name: str) -> str | None:
        return self._request.headers.get(name)

    async def read_some(self) -> bytes:
        return await self._request.content.readany()

    async def start_stream(self, headers: Mapping[str, str]) -> None:
        self._stream = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
        await self._stream.prepare(self._request)

    async def send(self, data: bytes) -> None:
        assert self._stream is not None, "start_stream() first"
        await self._stream.write(data)

    async def end(self) -> None:
        assert self._stream is not None, "start_stream() first"
        await self._stream.write_eof()

    def cut_off(self) -> None:
        # `abort`: `close` would wait for the client to read what is still buffered, which a
        # stalled client never does.
        transport = self._request.transport
        if transport is not None:
            transport.abort()

    def response(self, result: Result) -> web.StreamResponse:
        if isinstance(result, Answer):
            return web.Response(
                status=result.status,
                body=result.body,
                content_type=result.content_type,
                headers=result.headers,
            )
        # A stream, prepared (or, when the client left before its head went out, not: aiohttp
        # then has nothing to send on the closed connection).
        return self._stream if self._stream is not None else web.StreamResponse()
