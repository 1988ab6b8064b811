"""The orchestrator's handle on the tap process (`bench.tap`)."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen.driver import REPO


@dataclass(slots=True)
class Tap:
    """Routes label -> backend port; once started, `url(label)` is what a router is given."""

    log: Path
    routes: dict[str, int] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None

    def add(self, label: str, backend_port: int) -> None:
        self.routes[label] = backend_port

    def url(self, label: str) -> str:
        return f"http://127.0.0.1:{self.ports[label]}"

    async def start(self) -> None:
        with self.log.open("ab") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.tap",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                cwd=str(REPO),
                limit=1 << 26,
            )
        routes = [[label, backend] for label, backend in self.routes.items()]
        answer = await self._ask(json.dumps({"routes": routes}))
        self.ports = {label: int(port) for label, port in answer["ports"].items()}

    async def _ask(self, line: str) -> dict[str, Any]:
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line.encode() + b"\n")
        await proc.stdin.drain()
        async with asyncio.timeout(30):
            out = await proc.stdout.readline()
        if not out:
            raise RuntimeError(f"the tap exited; see {self.log}")
        answer: dict[str, Any] = json.loads(out)
        return answer

    async def dump(self) -> dict[str, Any]:
        """Marked request arrival times per label since the last dump (and health counts)."""
        return await self._ask("dump")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.write(b"quit\n")
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
