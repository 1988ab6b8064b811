"""narwhal-sim processes forked from one that imported the simulator once.

A simulator takes about 0.3 s of CPU to import, and the end-to-end tests start hundreds of
them. `SimSpawner` starts `python -m tests.support.sim_zygote` once per session; it imports
`narwhal.sim.cli` and forks a simulator per request in milliseconds. The fork is double (the
zygote's child forks the simulator and exits), and this process is a child subreaper
(`PR_SET_CHILD_SUBREAPER`), so each simulator becomes this process's own child: `ForkedSim`
waits for it, reads its exit status and signals it as `subprocess.Popen` does, with no pid
that could be reused under it. A test then kills, stops and restarts a simulator as it did
a process it started itself. The simulator's own start (`python -m narwhal.sim.cli`) stays
tested in `tests/sim`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any, NoReturn

import orjson

_PR_SET_CHILD_SUBREAPER = 36
_ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the zygote's side
def _child(request: dict[str, Any], fds: list[int]) -> NoReturn:
    code = 1
    try:
        stdout, stderr = fds
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["narwhal-sim", *request["argv"]]
        from narwhal.sim import cli

        cli.main(request["argv"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(sock: socket.socket) -> None:
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not message:
            return
        request = orjson.loads(message)
        pid_r, pid_w = os.pipe()
        middle = os.fork()
        if middle == 0:  # forks the simulator and exits: it is reparented to the subreaper
            os.close(pid_r)
            sock.close()
            sim = os.fork()
            if sim == 0:
                os.close(pid_w)
                _child(request, fds)
            os.write(pid_w, str(sim).encode())
            os._exit(0)
        os.close(pid_w)
        for fd in fds:
            os.close(fd)
        with os.fdopen(pid_r, "rb") as pipe:
            sim_pid = int(pipe.read())
        os.waitpid(middle, 0)  # once it is reaped, the simulator is the subreaper's child
        sock.send(orjson.dumps({"id": request["id"], "pid": sim_pid}))


def main() -> int:
    parser = argparse.ArgumentParser(prog="sim-zygote")
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args()
    from narwhal.sim import cli  # noqa: F401 - the import every simulator then shares

    _serve(socket.socket(fileno=args.fd))
    return 0


# ---------------------------------------------------------------- the test process's side
class ForkedSim:
    """A simulator forked by the zygote and reparented to this process: the part of
    `subprocess.Popen` that `SimProcess` uses."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        pidfd = os.pidfd_open(self.pid)
        try:
            exited, _, _ = select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)
        if not exited:
            raise subprocess.TimeoutExpired(f"narwhal-sim pid {self.pid}", timeout or 0.0)
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped: the pid is still this simulator's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class SimSpawner:
    """One zygote for a test session's simulators, started at the first spawn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._next_id = 0

    def spawn(self, argv: list[str]) -> ForkedSim:
        """A simulator running `narwhal-sim ARGV`, its stdout a pipe to this process."""
        read, write = os.pipe()
        try:
            with self._lock:
                sock = self._started()
                self._next_id += 1
                request = {
                    "id": self._next_id,
                    "argv": argv,
                    "env": dict(os.environ),
                    "cwd": os.getcwd(),
                }
                socket.send_fds(sock, [orjson.dumps(request)], [write, 2])
                answer = sock.recv(4096)
            if not answer:
                raise RuntimeError("the simulator zygote exited")
            reply = orjson.loads(answer)
            assert reply["id"] == request["id"], (reply, request)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        return ForkedSim(reply["pid"], os.fdopen(read, "rb"))

    def _started(self) -> socket.socket:
        if self._sock is None:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with theirs:
                self._proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.support.sim_zygote",
                        "--fd",
                        str(theirs.fileno()),
                    ],
                    pass_fds=(theirs.fileno(),),
                    cwd=_ROOT,
                )
            ours.settimeout(60.0)  # the first answer waits for the zygote's imports
            self._sock = ours
        return self._sock

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None:
                self._proc.wait(10)
                self._proc = None


if __name__ == "__main__":
    sys.exit(main())
