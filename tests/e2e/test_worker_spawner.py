"""The worker spawner on real processes: workers forked by a zygote, their exit statuses,
kill, what they inherit, and a zygote that dies (its workers with it, then a new one)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest

from narwhal.process.spawner import WorkerSpawner
from tests.support.poll import eventually


@pytest.fixture
async def spawner() -> AsyncIterator[WorkerSpawner]:
    own = WorkerSpawner()
    yield own
    await own.aclose()


@pytest.fixture
def table_fd() -> Iterator[int]:
    fd = os.memfd_create("test-table")
    yield fd
    os.close(fd)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_a_worker_is_forked_by_the_zygote_in_the_directory_of_the_request(
    spawner: WorkerSpawner, table_fd: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ours, theirs = socket.socketpair()
    try:
        proc = await spawner.spawn(0, theirs, table_fd, {})
        assert proc.returncode is None
        assert _ppid(proc.pid) == spawner.parent_pid != os.getpid()
        assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)  # tmp_path is real
        # Waiting for its hello: the control process closing the channel ends it, cleanly.
        ours.close()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert proc.returncode == 0
        proc.kill()  # an exited worker: nothing is sent, nothing fails
    finally:
        ours.close()
        theirs.close()


async def test_kill_is_a_sigkill_reported_as_the_signal(
    spawner: WorkerSpawner, table_fd: int
) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        proc = await spawner.spawn(3, theirs, table_fd, {})
        proc.kill()
        assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL


async def test_a_worker_that_crashes_prints_why_where_the_router_writes_and_exits_1(
    spawner: WorkerSpawner, table_fd: int, capfd: pytest.CaptureFixture[str]
) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        proc = await spawner.spawn(1, theirs, table_fd, {})
        ours.sendall(orjson.dumps({"t": "hello"}) + b"\n")  # a hello without its fields
        assert await asyncio.wait_for(proc.wait(), 10) == 1
    assert "KeyError: 'log'" in capfd.readouterr().err


async def test_a_zygote_that_dies_takes_its_workers_and_the_next_spawn_starts_another(
    spawner: WorkerSpawner, table_fd: int
) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        proc = await spawner.spawn(0, theirs, table_fd, {})
        first = spawner.parent_pid
        os.kill(first, signal.SIGKILL)
        assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
        # The worker, still waiting for its hello, really died with it (its death signal
        # is set at the fork), not only in the report.
        await eventually(lambda: _gone(proc.pid), timeout_s=10, what="worker gone")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        again = await spawner.spawn(0, theirs, table_fd, {})
        assert spawner.parent_pid != first
        assert _ppid(again.pid) == spawner.parent_pid
        again.kill()
        assert await asyncio.wait_for(again.wait(), 10) == -signal.SIGKILL


def test_one_spawner_serves_routers_on_successive_event_loops(table_fd: int) -> None:
    """A test session shares one spawner; each test runs its own event loop."""
    spawner = WorkerSpawner()

    async def one() -> int:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            proc = await spawner.spawn(0, theirs, table_fd, {})
            proc.kill()
            return await asyncio.wait_for(proc.wait(), 10)

    try:
        assert asyncio.run(one()) == -signal.SIGKILL
        first = spawner.parent_pid
        assert asyncio.run(one()) == -signal.SIGKILL
        assert spawner.parent_pid == first
    finally:
        asyncio.run(spawner.aclose())
