"""The worker spawner's process: `python -m narwhal.process.zygote --fd F --parent-pid P`.

It imports the data-plane worker once, then forks one child per request from the control
process (`process/spawner.py`); the child runs `narwhal.process.worker.main` at once, so a
worker starts in milliseconds instead of paying the interpreter's start and the worker's
imports (about 0.4 s of CPU) each time: at the router's start, at every restart after a
crash, and in a test suite that starts hundreds of routers.

It is single-threaded and has no event loop, so fork is safe here (the control process,
with its loop, threads and sessions, never forks). Requests and answers are JSON messages
on a `SOCK_SEQPACKET` socket; the worker's channel, table, stdout and stderr come with a
request as `SCM_RIGHTS` descriptors, so a worker writes where the router's process writes at
the time it is spawned. This process reaps its children and reports each exit as the
status `asyncio` would (negative: the signal). It dies with the control process
(`PR_SET_PDEATHSIG`), and its workers with it, the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any, NoReturn

import orjson

from narwhal.process import worker

MAX_MESSAGE_BYTES = 1 << 20
_FDS_PER_SPAWN = 4  # stdout, stderr, channel, table

_PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 70


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (even by SIGKILL): no orphan keeps the port.
    The check after closes the race where the parent died before the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:
        os._exit(EXIT_ORPHANED)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(orjson.dumps(message))


def _run_child(request: dict[str, Any], fds: list[int], zygote_pid: int) -> NoReturn:
    """In the forked child: become the worker the request names, then exit with its code.
    Nothing may return from here into the zygote's loop."""
    code = 1
    try:
        die_with_parent(zygote_pid)
        stdout, stderr, channel, table = fds
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        argv = ["--channel-fd", str(channel), "--table-fd", str(table)]
        code = worker.main([*argv, "--index", str(request["index"])])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a worker's crash is its exit status, reported
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class Zygote:
    """Forks workers on request and reports their exits."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.children: set[int] = set()
        self.pid = os.getpid()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()

    def serve(self) -> None:
        """Until the control process closes its end."""
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_w)
        with self._selector as selector:
            selector.register(self.sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            while len(os.read(self._wake_r, 512)) == 512:
                                pass
                    elif not self._request():
                        return
                self._reap()

    def _request(self) -> bool:
        message, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, _FDS_PER_SPAWN)
        if not message:
            for fd in fds:
                os.close(fd)
            return False
        request = orjson.loads(message)
        if request["op"] == "spawn":
            self._spawn(request, fds)
        elif request["op"] == "kill" and request["pid"] in self.children:
            # A child not yet reaped: the pid is still this child's, never a reused one.
            os.kill(request["pid"], signal.SIGKILL)
        return True

    def _spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        try:
            if len(fds) != _FDS_PER_SPAWN:
                raise OSError(f"spawn needs {_FDS_PER_SPAWN} descriptors, got {len(fds)}")
            pid = os.fork()
        except OSError as exc:
            _send(self.sock, {"op": "failed", "id": request["id"], "error": str(exc)})
            for fd in fds:
                os.close(fd)
            return
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self._selector.close()
            self.sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            _run_child(request, fds, self.pid)
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        _send(self.sock, {"op": "spawned", "id": request["id"], "pid": pid})

    def _reap(self) -> None:
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            self.children.discard(pid)
            _send(self.sock, {"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal-zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the control process decides
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    # A write to a control process that is gone: so are the workers, by their death signal.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        Zygote(sock).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
