"""The client side of one request, whatever serves HTTP: the seam between the data plane and
the server (DESIGN §9; docs/design/raw-server.md).

`DataPlane.handle` reads the client's body and, for a stream, writes it through an
`Exchange`, and returns a `Result`: an `Answer` the server sends once `handle` returns (after
the request's evidence has settled), or `Streamed` when the answer already went out as a
stream. The HTTP/1.1 server's `ServerRequest` (process/h1_server.py) is the one `Exchange`,
in every process mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from narwhal.dataplane.record import RequestRecord
from narwhal.dataplane.requests import BadRequest

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


class BodyRefused(BadRequest):
    """The server will not take the rest of the body: past `serving.max_body_bytes` (413)
    or too slow (408, `serving.client_body_timeout_s`). `read_some` raises it; the data
    plane answers it as any bad request."""


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
        """The next piece of the body; b"" at its end. The first call says the handler wants
        the body (a waiting client gets `100 Continue` then); `BodyRefused` when the server
        refused the body."""
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
