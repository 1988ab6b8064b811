"""`python -m bench.traced SNAPSHOT_DIR narwhal-serve-args...`: Narwhal under tracemalloc.

Each SIGUSR1 writes a tracemalloc snapshot to SNAPSHOT_DIR/snap-<n>.bin. Used by the streams
suite to attribute a stream's memory to the code that allocated it; never part of a timed run
(tracemalloc slows every allocation).
"""

from __future__ import annotations

import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(1)
    taken = 0

    def snapshot(signum: int, frame: FrameType | None) -> None:
        nonlocal taken
        path = out / f"snap-{taken}.bin"
        tracemalloc.take_snapshot().dump(str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)
        taken += 1

    signal.signal(signal.SIGUSR1, snapshot)
    from narwhal.cli.serve import main as serve

    return serve(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
