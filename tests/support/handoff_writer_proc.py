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

Every document can be checked on its own (`check_document_bytes`): its body is derived from
(writer, n), so a torn write or a mix of two documents is detected, not only broken JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def body_for(writer: str, n: int, size: int) -> str:
    unit = f"{writer}:{n};"
    return (unit * (size // len(unit) + 1))[:size]


def make_document(writer: str, n: int, size: int) -> bytes:
    doc = {"writer": writer, "n": n, "pid": os.getpid(), "size": size}
    doc["body"] = body_for(writer, n, size)
    return json.dumps(doc).encode()


def check_document_bytes(raw: bytes) -> dict[str, Any]:
    """Parse a document and verify it is one complete document; raise if not."""
    doc: dict[str, Any] = json.loads(raw)
    expected = body_for(doc["writer"], doc["n"], doc["size"])
    if doc["body"] != expected:
        raise ValueError(f"document {doc['writer']}:{doc['n']} has a foreign or torn body")
    return doc


def write_loop(dest: Path, writer: str, start: int, count: int, size: int) -> None:
    from narwhal.state.atomic import atomic_write

    n = start
    while count < 0 or n < start + count:
        atomic_write(dest, make_document(writer, n, size))
        n += 1


def serve(dest: Path, writer: str, size: int) -> None:
    from narwhal.state import atomic  # noqa: F401  (imported once, before any fork)

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
