"""A tiny handoff writer, run as a subprocess by the crash and concurrency tests.

    python handoff_writer_proc.py write DEST WRITER START COUNT SIZE
    python handoff_writer_proc.py serve DEST WRITER SIZE

`write` writes numbered documents START, START+1, ... to DEST with `atomic_write`, COUNT of
them (a negative COUNT: until killed). It prints `ready` once its imports are done, so a test
can kill it inside its write loop rather than during interpreter start.

`serve` makes writers cheaply, for tests that kill hundreds of them: for each stdin line
`spawn START` it forks a child process that runs the same endless write loop from START and
prints `child PID`; for `reap PID` it waits for that child (which the test has killed) and
prints `reaped PID STATUS`, so the dead writer's pid is really gone. EOF ends it.

Documents are real handoffs (`build_document`, sequence n + 1, router id WRITER) for a fleet
of about SIZE / 300 engines, so SIZE is roughly the document's size. Every engine carries
values derived from (writer, n) -- its generation and, on every other engine, an operator
drain whose reason is `writer:n` -- so content from two documents differs throughout.
`check_document_bytes` validates a document with `check_document` (JSON, schema, checksum,
engine set) and then checks those derived values: a torn write or a mix of two documents is
refused, not only broken JSON.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from narwhal.clock import FakeClock
from narwhal.config import Config, parse_config
from narwhal.fleet.events import GenerationSeen, HoldRequested
from narwhal.fleet.holds import HoldName
from narwhal.fleet.store import Fleet
from narwhal.state.handoff import build_document, check_document, load_schema

ENGINE_BYTES = 300  # about one engine's share of an indented document


@functools.cache
def fleet_config(size: int) -> Config:
    count = max(2, size // ENGINE_BYTES)
    engines = [
        {"id": f"e{i}", "url": f"http://127.0.0.1:{20000 + i}",
         "role": "prefill" if i % 2 == 0 else "decode"}
        for i in range(count)
    ]  # fmt: skip
    return parse_config({"listen": "127.0.0.1:0", "model": "m", "engines": engines})


@functools.cache
def schema() -> dict[str, Any]:
    return load_schema()


def _reason(writer: str, n: int) -> str:
    return f"{writer}:{n}"


def make_document(writer: str, n: int, size: int) -> bytes:
    config = fleet_config(size)
    fleet = Fleet(config.engines, FakeClock(wall=1_700_000_000.0))
    for i, engine in enumerate(fleet):
        fleet.apply(GenerationSeen(engine.id, float(n) + i / 1000), 0.0)
        if i % 2 == 0:
            fleet.apply(HoldRequested(engine.id, HoldName.OPERATOR_DRAIN, _reason(writer, n)), 0.0)
    doc = build_document(fleet, n + 1, 1_700_000_000.0 + n, writer, None, {})
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


def check_document_bytes(raw: bytes) -> dict[str, Any]:
    """Verify `raw` is one complete, valid document; raise if not. Returns `writer`, `n`
    and `pid` (of the writing process) and the `document` itself."""
    doc = orjson.loads(raw)  # which size: the engine set tells
    config = fleet_config(len(doc["engine_set"]) * ENGINE_BYTES)
    verdict = check_document(raw, config, schema())
    if not verdict.ok or verdict.document is None:
        raise ValueError(f"not a valid handoff: {verdict.reason}")
    doc = verdict.document
    writer, n = doc["writer"]["router_id"], doc["sequence"] - 1
    for i, engine_id in enumerate(e.id for e in config.engines):
        engine = doc["engines"][engine_id]
        drains = [h["reason"] for h in engine["holds"]]
        if engine["generation"] != float(n) + i / 1000 or drains != (
            [_reason(writer, n)] if i % 2 == 0 else []
        ):
            raise ValueError(f"document {writer}:{n} has foreign values on {engine_id}")
    return {"writer": writer, "n": n, "pid": doc["writer"]["pid"], "document": doc}


def write_loop(dest: Path, writer: str, start: int, count: int, size: int) -> None:
    from narwhal.state.atomic import atomic_write

    fleet_config(size)  # parsed once, before the loop (and before any fork)
    n = start
    while count < 0 or n < start + count:
        atomic_write(dest, make_document(writer, n, size))
        n += 1


def serve(dest: Path, writer: str, size: int) -> None:
    from narwhal.state import atomic  # noqa: F401  (imported once, before any fork)

    fleet_config(size)

    for line in sys.stdin:
        command, arg = line.split()
        if command == "spawn":
            pid = os.fork()
            if pid == 0:  # the writer: never returns, dies by SIGKILL
                try:
                    write_loop(dest, writer, int(arg), -1, size)
                finally:
                    os._exit(1)
            print(f"child {pid}", flush=True)
        elif command == "reap":
            _, status = os.waitpid(int(arg), 0)
            print(f"reaped {arg} {status}", flush=True)


def main(argv: list[str]) -> int:
    mode, dest, writer = argv[0], Path(argv[1]), argv[2]
    if mode == "serve":
        serve(dest, writer, int(argv[3]))
        return 0
    start, count, size = map(int, argv[3:6])
    from narwhal.state import atomic  # noqa: F401

    print("ready", flush=True)
    write_loop(dest, writer, start, count, size)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
