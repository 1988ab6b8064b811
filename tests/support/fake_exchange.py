"""An `Exchange` (dataplane/exchange.py) without a server, for unit tests of the request path's
pieces: the body comes in the chunks given, what is sent is kept, and a client that left
(`gone`) makes every send fail as a reset connection does."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from narwhal.dataplane.record import RequestRecord


class FakeExchange:
    def __init__(
        self,
        chunks: Iterable[bytes] = (),
        *,
        headers: Mapping[str, str] | None = None,
        content_length: int | None = None,
        record: RequestRecord | None = None,
    ) -> None:
        self.settled_outcome: str | None = None
        self.record = record
        self._chunks = list(chunks)
        self._headers = {k.lower(): v for k, v in (headers or {}).items()}
        self._length = content_length
        self.reads = 0
        self.sent: list[bytes] = []
        self.ended = False
        self.cut = False
        self.gone = False

    @property
    def content_length(self) -> int | None:
        return self._length

    def header(self, name: str) -> str | None:
        return self._headers.get(name)

    async def read_some(self) -> bytes:
        self.reads += 1
        return self._chunks.pop(0) if self._chunks else b""

    async def start_stream(self, headers: Mapping[str, str]) -> None:
        pass

    async def send(self, data: bytes) -> None:
        if self.gone:
            raise ConnectionResetError("the client left")
        self.sent.append(data)

    async def end(self) -> None:
        if self.gone:
            raise ConnectionResetError("the client left")
        self.ended = True

    def cut_off(self) -> None:
        self.cut = True
