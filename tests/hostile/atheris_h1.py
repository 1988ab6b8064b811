"""Coverage-guided fuzzing (atheris, libFuzzer) of the HTTP/1 server's connection: the parser
shell (`process/h1_connection.py`) around its state machine (`process/h1_state.py`), fed bytes
split at fuzzed points over a fake transport, with handlers that read the body and answer.

Run by `tests/hostile/test_atheris.py` in a subprocess for a bounded time; by hand:
`python -m tests.hostile.atheris_h1 -max_total_time=60` (libFuzzer's flags). A crash is any
exception out of the protocol's callbacks (a `ProtocolError` is the shell's bug) or a broken
rule on what the client got:
- everything written is a sequence of well-formed HTTP/1.1 answers, each with its length;
- no answer is a 5xx (nothing a client sends is the server's fault);
- nothing is written once the connection is closing;
- a handler only sees a body within `max_body_bytes`.
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports():
    from narwhal.process.h1_connection import ServerConnection
    from narwhal.process.h1_request import ServerRequest
    from narwhal.process.h1_server import H1Server
    from narwhal.process.h1_state import Limits

LIMITS = Limits(max_body_bytes=256, max_head_bytes=1024)
ALLOWED = {100, 200, 400, 404, 405, 408, 413, 431}


class Transport(asyncio.Transport):
    """What the connection writes, and what it asks of its socket."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closing:
            raise AssertionError(f"written after the close: {bytes(data)[:80]!r}")
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def _echo(request: ServerRequest) -> None:
    body = await request.read()  # a refusal raises BodyRefused: the server answers it
    if len(body) > LIMITS.max_body_bytes:
        raise AssertionError(f"a handler got {len(body)} bytes of body")
    request.respond(200, b'{"bytes": %d}' % len(body), "application/json")


async def _health(request: ServerRequest) -> None:
    request.respond(200, b"ok", "text/plain")


async def _missing(request: ServerRequest) -> None:
    request.respond(404, b'{"error": "not found"}', "application/json")


def _statuses(out: bytes) -> list[int]:
    """The status of each answer in `out`, read strictly; AssertionError when an answer is not
    well formed. A `Content-Length` answer followed at once by the next answer (or by the
    end) is an answer to HEAD, which has no body."""
    statuses = []
    rest = out
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if not sep:
            raise AssertionError(f"an answer's head cut short: {head[:200]!r}")
        line, *fields = head.split(b"\r\n")
        match = re.fullmatch(rb"HTTP/1\.1 (\d{3}) [ -~]+", line)
        if match is None:
            raise AssertionError(f"not a status line: {line[:200]!r} in {out[:300]!r}")
        statuses.append(int(match[1]))
        headers = {}
        for field in fields:
            name, colon, value = field.partition(b": ")
            if not colon or not re.fullmatch(rb"[A-Za-z-]+", name):
                raise AssertionError(f"not a header: {field[:200]!r}")
            headers[name.lower()] = value
        if statuses[-1] == 100:
            continue
        length = headers.get(b"content-length")
        if length is None or not length.isdigit():
            raise AssertionError(f"an answer without a length: {head[:300]!r}")
        if rest.startswith(b"HTTP/1.1 ") or not rest:
            continue  # HEAD's answer
        if len(rest) < int(length):
            raise AssertionError(f"a body cut short: {head[:200]!r}")
        rest = rest[int(length) :]
    return statuses


def _check(out: bytes) -> None:
    bad = [s for s in _statuses(out) if s not in ALLOWED]
    if bad:
        raise AssertionError(f"answered {bad}: {out[:300]!r}")


async def _one(pieces: list[bytes]) -> bytes:
    routes = {"/v1/completions": {"POST": _echo}, "/health": {"GET": _health}}
    server = H1Server(routes, _missing, limits=LIMITS)
    connection = ServerConnection(server)
    transport = Transport()
    connection.connection_made(transport)
    for piece in pieces:
        if transport.closing:
            break
        connection.data_received(piece)
        await asyncio.sleep(0)
    for _ in range(8):  # let the handlers read and answer
        await asyncio.sleep(0)
    connection.connection_lost(None)
    await asyncio.sleep(0)
    return bytes(transport.out)


LOOP = asyncio.new_event_loop()


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    pieces = []
    while fdp.remaining_bytes():
        pieces.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 64)))
    _check(LOOP.run_until_complete(_one(pieces)))


SEEDS = (
    b"\x10POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    b"\x08GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x20POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Expect: 100-continue\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
)


# libFuzzer's dictionary: the pieces of HTTP/1 it would take long to guess byte by byte
TOKENS = (
    b"POST /v1/completions HTTP/1.1\r\n", b"GET /health HTTP/1.1\r\n", b"HEAD /health HTTP/1.0",
    b"Host: x\r\n", b"Content-Length: ", b"Transfer-Encoding: chunked\r\n", b"identity",
    b"Expect: 100-continue\r\n", b"Connection: close\r\n", b"Connection: keep-alive\r\n",
    b"Upgrade: h2c\r\n", b"\r\n\r\n", b"0\r\n\r\n", b"\r\n", b" HTTP/1.1", b";ext=1",
    b"PRI * HTTP/2.0", b"\r\n ", b"\n",
)  # fmt: skip


def _quoted(token: bytes) -> str:
    return '"' + "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\x{b:02x}"
                         for b in token) + '"'  # fmt: skip


def main() -> None:
    """libFuzzer's flags from the command line; a corpus directory too, or a new one with
    the seeds (libFuzzer exits the process when done: nothing is cleaned up after it)."""
    for seed in SEEDS:  # the rules hold for well-formed requests first
        test_one_input(seed)
    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):
        argv.append(tempfile.mkdtemp(prefix="narwhal-h1-fuzz-"))
    corpus = Path(next(a for a in argv[1:] if not a.startswith("-")))
    for i, seed in enumerate(SEEDS):
        (corpus / f"seed-{i}").write_bytes(seed)
    dictionary = corpus.parent / f"{corpus.name}.dict"
    dictionary.write_text("\n".join(_quoted(t) for t in TOKENS) + "\n")
    atheris.Setup([*argv, f"-dict={dictionary}"], test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
