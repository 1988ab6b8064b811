"""Atomic handoff writes across real processes (spec "Atomic handoff writes"; DESIGN §4).

Writers are separate Python processes (tests/support/handoff_writer_proc.py) using
`atomic_write` in a loop:

- Crash consistency: writers killed with SIGKILL at random points, a few hundred times;
  after every kill the destination is one complete document, the old one or a newer one,
  never a mix; the dead writer's temporary file (if the kill landed mid-write) is removed
  by `remove_stale_temps`, so leftovers never accumulate.
- Concurrent writers: eight processes write different documents to one destination; every
  read meanwhile and the final file are one complete document; no temporary file remains.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from narwhal.state.atomic import atomic_write, remove_stale_temps
from tests.support.handoff_writer_proc import check_document_bytes, make_document

WRITER = Path(__file__).resolve().parents[1] / "support" / "handoff_writer_proc.py"
LANES = 4
KILLS_PER_LANE = 75  # 300 kills in all
SIZE = 32 * 1024
TEMP = re.compile(r"^\.handoff\.json\.(\d+)\.[0-9a-f]{8}\.[0-9a-f]+\.tmp$")  # pid, host, random


def spawn(dest: Path, writer: str, start: int, count: int, size: int) -> subprocess.Popen[bytes]:
    """A writer process of its own (interpreter start included)."""
    args = ["write", str(dest), writer, str(start), str(count), str(size)]
    return subprocess.Popen(
        [sys.executable, str(WRITER), *args], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )


class ForkServer:
    """Writer processes forked on demand by one helper process: cheap enough to kill
    hundreds of writers. Each writer is a real process with its own pid; the test kills it
    with SIGKILL and the helper reaps it, so its pid is really gone."""

    def __init__(self, dest: Path, writer: str, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER), "serve", str(dest), writer, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def _ask(self, line: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().decode().split()

    def spawn(self, start: int) -> int:
        word, pid = self._ask(f"spawn {start}")
        assert word == "child"
        return int(pid)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        word, reaped, status = self._ask(f"reap {pid}")
        assert (word, int(reaped)) == ("reaped", pid)
        assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        assert self.proc.wait(10) == 0
        self.proc.stdout.close()


@dataclass
class LaneResult:
    kills: int = 0
    kills_mid_write: int = 0  # the kill left a temporary file behind
    kills_after_progress: int = 0  # the destination moved on before the kill
    documents_advanced: int = 0


def crash_lane(lane: int, root: Path, seed: int) -> LaneResult:
    rng = random.Random(seed)
    directory = root / f"lane{lane}"
    directory.mkdir()
    dest = directory / "handoff.json"
    writer = f"w{lane}"
    atomic_write(dest, make_document(writer, 0, SIZE))
    current = 0
    result = LaneResult()
    server = ForkServer(dest, writer, SIZE)
    try:
        for _ in range(KILLS_PER_LANE):
            pid = server.spawn(current + 1)
            threading.Event().wait(rng.choice([0.0, rng.uniform(0.0, 0.008)]))
            server.kill(pid)
            result.kills += 1

            # One complete document: the old one or a newer one of this writer, never a mix.
            doc = check_document_bytes(dest.read_bytes())
            assert doc["writer"] == writer
            assert doc["n"] >= current, (doc["n"], current)
            if doc["n"] > current:
                result.kills_after_progress += 1
                result.documents_advanced += doc["n"] - current
                assert doc["pid"] == pid
            current = doc["n"]

            leftovers = [p for p in directory.iterdir() if p != dest]
            assert len(leftovers) <= 1, leftovers  # one writer, one temporary file at a time
            for tmp in leftovers:
                match = TEMP.match(tmp.name)
                assert match and int(match[1]) == pid, tmp.name
            result.kills_mid_write += len(leftovers)
            assert sorted(remove_stale_temps(dest)) == sorted(leftovers)
            assert list(directory.iterdir()) == [dest]
    finally:
        server.close()
    return result


@pytest.mark.slow
def test_writers_killed_at_random_points_leave_one_complete_document(tmp_path: Path) -> None:
    with ThreadPoolExecutor(LANES) as pool:
        results = list(pool.map(crash_lane, range(LANES), [tmp_path] * LANES, range(LANES)))
    kills = sum(r.kills for r in results)
    assert kills == LANES * KILLS_PER_LANE
    # The kills really landed in the write loop: some mid-write (a temporary file left for
    # remove_stale_temps), some after documents had been renamed into place.
    assert sum(r.kills_mid_write for r in results) > 0
    assert sum(r.kills_after_progress for r in results) > 0
    print(
        f"\n{kills} kills: {sum(r.kills_mid_write for r in results)} mid-write, "
        f"{sum(r.kills_after_progress for r in results)} after progress, "
        f"{sum(r.documents_advanced for r in results)} documents written"
    )


def test_stale_temporary_files_do_not_accumulate_across_crashes(tmp_path: Path) -> None:
    """Without cleanup each crash may leave one file; one `remove_stale_temps` clears all."""
    dest = tmp_path / "handoff.json"
    atomic_write(dest, make_document("w", 0, SIZE))
    left: set[Path] = set()
    server = ForkServer(dest, "w", SIZE)
    try:
        for i in range(40):
            server.kill(server.spawn(1))
            threading.Event().wait(0.0005 * (i % 4))
            left |= {p for p in tmp_path.iterdir() if p != dest}
            check_document_bytes(dest.read_bytes())
    finally:
        server.close()
    assert len(left) <= 40
    assert set(remove_stale_temps(dest)) == left
    assert list(tmp_path.iterdir()) == [dest]


def test_a_killed_writer_process_leaves_the_destination_whole(tmp_path: Path) -> None:
    """The plain case with a writer started as its own interpreter."""
    dest = tmp_path / "handoff.json"
    atomic_write(dest, make_document("w", 0, SIZE))
    for _ in range(5):
        proc = spawn(dest, "w", 1, -1, SIZE)
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        threading.Event().wait(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        proc.stdout.close()
        assert check_document_bytes(dest.read_bytes())["writer"] == "w"
        remove_stale_temps(dest)
        assert list(tmp_path.iterdir()) == [dest]


WRITERS = 8
COUNT = 300
CONCURRENT_SIZE = 32 * 1024


@pytest.mark.slow
def test_concurrent_writers_leave_one_complete_document_and_no_temporary_file(
    tmp_path: Path,
) -> None:
    dest = tmp_path / "handoff.json"
    procs = [spawn(dest, f"w{i}", 0, COUNT, CONCURRENT_SIZE) for i in range(WRITERS)]
    reads = 0
    seen: set[str] = set()
    try:
        # While they race, every read of the destination is one complete document.
        while any(p.poll() is None for p in procs):
            try:
                raw = dest.read_bytes()
            except FileNotFoundError:
                continue  # before the first rename
            seen.add(check_document_bytes(raw)["writer"])
            reads += 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    statuses = [p.wait() for p in procs]
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.read() == b"ready\n"
        p.stdout.close()
    assert statuses == [0] * WRITERS
    doc = check_document_bytes(dest.read_bytes())
    assert doc["writer"] in {f"w{i}" for i in range(WRITERS)}
    # The last rename of all is its writer's last document.
    assert doc["n"] == COUNT - 1
    assert doc["pid"] in {p.pid for p in procs}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["handoff.json"]
    assert reads > 0
    assert len(seen) > 1, seen  # the writers really raced
