"""The orchestrator's handle on the load generator process."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from bench.loadgen.flow import FlowResult, FlowSpec
from bench.loadgen.spec import RunResult, RunSpec

REPO = Path(__file__).resolve().parents[2]


class LoadGen:
    def __init__(self, python: str, log: Path) -> None:
        self._python = python
        self._log = log
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with self._log.open("ab") as err:
            self._proc = await asyncio.create_subprocess_exec(
                self._python,
                "-m",
                "bench.loadgen.worker",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=str(REPO),
                limit=1 << 26,
            )

    async def _ask(self, command: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps(command) + "\n").encode())
        await proc.stdin.drain()
        async with asyncio.timeout(timeout_s):
            line = await proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator exited; see {self._log}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def run(self, spec: RunSpec) -> RunResult:
        timeout = spec.duration_s + spec.deadline_s + 120
        answer = await self._ask({"cmd": "run", "spec": spec.to_json()}, timeout)
        return RunResult.from_json(answer["result"])

    async def flow(self, spec: FlowSpec) -> FlowResult:
        """An open-loop run of the `flow` suite (bench.loadgen.flow)."""
        timeout = spec.duration_s + spec.deadline_s + 120
        answer = await self._ask({"cmd": "flow", "spec": spec.to_json()}, timeout)
        return FlowResult.from_json(answer["result"])

    async def reset(self) -> None:
        await self._ask({"cmd": "reset"}, 30)

    async def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
