"""Child processes: start one and wait for its ready line, read its CPU and memory, stop it.

CPU comes from /proc/<pid>/stat (utime + stime of the whole thread group), memory from
/proc/<pid>/status (VmRSS, VmHWM). Writing "5" to /proc/<pid>/clear_refs resets VmHWM, so a
run's peak can be measured on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_s: float
    rss_kb: int
    hwm_kb: int


def usage(pid: int) -> Usage:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    mem = {"VmRSS": 0, "VmHWM": 0}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in mem:
            mem[key] = int(value.split()[0])
    return Usage(cpu, mem["VmRSS"], mem["VmHWM"])


def reaped_cpu_s(pid: int) -> float:
    """CPU of the process's children that have exited and been waited for (cutime + cstime):
    what a child that died during a measurement spent, once its parent reaped it."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[13]) + int(fields[14])) / _TICKS


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS; False when the kernel refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


_LIVE: set[Proc] = set()  # every child not yet stopped, for `stop_all` at exit


async def stop_all() -> None:
    """Stop every child still running (the safety net behind each suite's own cleanup)."""
    for proc in list(_LIVE):
        await proc.stop(grace_s=2.0)


class Proc:
    """One child process in its own process group, with stdout and stderr in files."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self.drain: asyncio.Task[None] | None = None
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def usage(self) -> Usage:
        return usage(self.pid)

    def signal(self, sig: signal.Signals) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def stop(self, grace_s: float = 5.0) -> None:
        _LIVE.discard(self)
        if not self.alive:
            return
        self.signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.proc.wait()

    async def kill(self) -> None:
        _LIVE.discard(self)
        self.signal(signal.SIGKILL)
        await self.proc.wait()


def _open_log(log_dir: Path, name: str) -> tuple[Path, BinaryIO]:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    return log, log.open("ab")


async def spawn(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    *,
    ready: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> tuple[Proc, re.Match[str] | None]:
    """Start `argv`; with `ready`, wait for a stdout or log line matching that regex."""
    log, out = _open_log(log_dir, name)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if ready else out,
            stderr=out,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    finally:
        out.close()
    child = Proc(name, proc, log)
    if ready is None:
        return child, None
    assert proc.stdout is not None
    pattern = re.compile(ready)
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                line = (await proc.stdout.readline()).decode(errors="replace")
                if not line:
                    raise RuntimeError(f"{name} exited before it was ready; see {log}")
                if match := pattern.search(line):
                    break
    except BaseException:
        await child.stop()
        raise
    child.drain = asyncio.get_running_loop().create_task(_drain(proc.stdout, log))
    return child, match


async def _drain(stream: asyncio.StreamReader, log: Path) -> None:
    """Keep reading a child's stdout into its log so the pipe never fills."""
    with log.open("ab") as out:
        while chunk := await stream.read(65536):
            out.write(chunk)


def descendants(parent_of: Mapping[int, int], root: int) -> list[int]:
    """`root` and every process below it, given each process's parent (pid -> ppid)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += sorted(children.get(pid, ()), reverse=True)
    return out


def _parents() -> dict[int, int]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        out[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    return out


def tree(pid: int) -> list[int]:
    return descendants(_parents(), pid)


def tree_usage(pid: int) -> tuple[float, int, int]:
    """(CPU s, summed VmHWM KB, processes) over the process tree rooted at `pid`."""
    cpu, hwm, n = reaped_cpu_s(pid), 0, 0
    for p in tree(pid):
        try:
            u = usage(p)
        except (OSError, ValueError):
            continue  # gone in the meantime
        cpu, hwm, n = cpu + u.cpu_s, hwm + u.hwm_kb, n + 1
    return cpu, hwm, n
