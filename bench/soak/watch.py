"""What the soak observes while it runs, by polling (no state is waited for by sleeping):
both routers' `/ready` (every `interval_s`), the handoff file (does it parse?), and each
router process's open file descriptors and RSS (every second)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.procs import usage
from bench.soak.pair import Pair


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def handoff_state(path: Path) -> str:
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        return "away"  # the soak replaced the directory by a file
    except (ValueError, UnicodeDecodeError):
        return "unparseable"
    return "ok" if isinstance(doc, dict) and "sequence" in doc else "unparseable"


@dataclass(slots=True)
class Watch:
    pair: Pair
    interval_s: float = 0.1
    ready: list[tuple[float, int | None, int | None]] = field(default_factory=list)
    handoff: list[tuple[float, str]] = field(default_factory=list)
    procs: list[tuple[float, str, int, int, int]] = field(
        default_factory=list
    )  # t,name,pid,fds,rss
    away: bool = False  # the handoff directory is moved away on purpose
    _task: asyncio.Task[None] | None = None
    _session: aiohttp.ClientSession | None = None

    def active(self) -> str | None:
        """The router that answered /ready 200 in the latest poll (alone)."""
        for _, a, b in reversed(self.ready[-3:]):
            if a == 200 and b != 200:
                return "a"
            if b == 200 and a != 200:
                return "b"
        return None

    async def _status(self, name: str) -> int | None:
        assert self._session is not None
        url = self.pair.members[name].url + "/ready"
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
                return r.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def _run(self) -> None:
        next_proc = 0.0
        while True:
            a, b = await asyncio.gather(self._status("a"), self._status("b"))
            now = time.monotonic()
            self.ready.append((now, a, b))
            state = handoff_state(self.pair.handoff)
            self.handoff.append((now, "away" if self.away and state != "ok" else state))
            if now >= next_proc:
                next_proc = now + 1.0
                for name in ("a", "b"):
                    pid = self.pair.pid(name)
                    fds = fd_count(pid) if pid else None
                    if pid and fds:  # a killed, not yet reaped process has no fds
                        with contextlib.suppress(OSError, ValueError):
                            rss = usage(pid).rss_kb
                            if rss:
                                self.procs.append((now, name, pid, fds, rss))
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> Watch:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._session is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._session.close()
