"""Starting data-plane workers: forked by a zygote process that has imported them.

The control process never forks (its loop, threads and sessions would be copied into the
child). It starts one `python -m narwhal.process.zygote` instead, which imports the worker
once and forks a worker per request in milliseconds (`process/zygote.py`). A worker here is
a `SpawnedWorker`: the pid, exit status, `wait` and `kill` the supervisor needs, answered
by the zygote, which is the worker's parent and reaps it.

A zygote that dies takes its workers with it (their death signal); their exits are then
reported as SIGKILL, and the next spawn starts a new zygote. One spawner can serve several
routers in turn, each on its own event loop (a test session shares one): the socket is
watched by the loop of the latest spawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import orjson

from narwhal.process.zygote import MAX_MESSAGE_BYTES

log = logging.getLogger("narwhal.spawner")

SPAWN_TIMEOUT_S = 30.0  # the first spawn waits for the zygote's imports too


class SpawnedWorker:
    """A worker process forked by the zygote (the part of `asyncio.subprocess.Process` the
    supervisor uses)."""

    def __init__(self, spawner: WorkerSpawner, pid: int, exited: asyncio.Future[int]) -> None:
        self.pid = pid
        self._spawner = spawner
        self._exited = exited

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        """SIGKILL, sent by the zygote: only it knows the pid is still this worker's."""
        if not self._exited.done():
            self._spawner.send({"op": "kill", "pid": self.pid})


class WorkerSpawner:
    """The control process's end of one zygote, started at the first spawn."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}

    @property
    def parent_pid(self) -> int:
        """The workers' parent (their death signal is tied to it); valid after a spawn."""
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> None:
        """Start the zygote now (its imports then overlap the router's own start), and
        watch it from the running loop."""
        self._attach()

    async def spawn(
        self, index: int, channel: socket.socket, table_fd: int, env: dict[str, str]
    ) -> SpawnedWorker:
        """Fork worker `index` on `channel` and the shared table; raises OSError when the
        zygote cannot (its own start failed, fork failed, or it did not answer)."""
        self._attach()
        loop = asyncio.get_running_loop()
        self._next_id += 1
        request_id = self._next_id
        answer = self._pending[request_id] = loop.create_future()
        request = {"op": "spawn", "id": request_id, "index": index, "env": env, "cwd": os.getcwd()}
        try:
            assert self._sock is not None
            socket.send_fds(self._sock, [orjson.dumps(request)], [1, 2, channel.fileno(), table_fd])
            async with asyncio.timeout(SPAWN_TIMEOUT_S):
                pid = await answer
        except TimeoutError:
            self._lost("did not answer a spawn")
            raise OSError("the worker spawner did not answer") from None
        finally:
            self._pending.pop(request_id, None)
        exited = self._exits.setdefault(pid, loop.create_future())
        return SpawnedWorker(self, pid, exited)

    def send(self, message: dict[str, Any]) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):  # a lost zygote is noticed by the reader
                self._sock.send(orjson.dumps(message))

    async def aclose(self) -> None:
        """Stop the zygote (call once its workers are gone: they die with it)."""
        proc = self._proc
        self._lost(None)
        if proc is not None:
            await asyncio.to_thread(proc.wait)

    # ---------------------------------------------------------------- internals
    def _attach(self) -> None:
        """Start a zygote if there is none, and watch it from the running loop."""
        loop = asyncio.get_running_loop()
        if self._sock is None:
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "narwhal.process.zygote", "--fd", str(child.fileno()),
                     "--parent-pid", str(os.getpid())],
                    pass_fds=(child.fileno(),),
                )  # fmt: skip
            except OSError:
                parent.close()
                raise
            finally:
                child.close()
            parent.setblocking(False)
            self._sock = parent
            self._loop = None
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            loop.add_reader(self._sock.fileno(), self._readable)
            self._loop = loop

    def _readable(self) -> None:
        while self._sock is not None:
            try:
                message = self._sock.recv(MAX_MESSAGE_BYTES)
            except BlockingIOError:
                return
            except OSError:
                message = b""
            if not message:
                self._lost("exited")
                return
            self._answer(orjson.loads(message))

    def _answer(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "spawned":
            _settle(self._pending.get(message["id"]), message["pid"])
        elif op == "failed":
            future = self._pending.get(message["id"])
            if future is not None and not future.done() and not future.get_loop().is_closed():
                future.set_exception(OSError(f"the worker spawner: {message['error']}"))
        elif op == "exit":
            future = self._exits.pop(message["pid"], None)
            if future is None and self._loop is not None:  # exited before `spawn` resumed
                future = self._exits[message["pid"]] = self._loop.create_future()
            _settle(future, message["code"])

    def _lost(self, why: str | None) -> None:
        """The zygote is gone (or is being stopped): so are its workers."""
        if self._sock is None:
            return
        if why is not None:
            log.warning("worker spawner (pid %s) %s; its workers die with it", self.parent_pid, why)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        self._loop = None
        if why is not None and self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        for future in self._pending.values():
            if not future.done() and not future.get_loop().is_closed():
                future.set_exception(OSError(f"the worker spawner {why or 'stopped'}"))
        for future in self._exits.values():
            _settle(future, -signal.SIGKILL)
        self._exits.clear()


def _settle(future: asyncio.Future[int] | None, value: int) -> None:
    if future is not None and not future.done() and not future.get_loop().is_closed():
        future.set_result(value)
