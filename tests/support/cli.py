"""The operator CLI (`narwhal`) as a subprocess, with a clean environment: no `NARWHAL_*`
variable of the test process leaks into it unless given."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass


@dataclass
class Cli:
    code: int
    out: str
    err: str


async def narwhal(*args: str, env: dict[str, str] | None = None) -> Cli:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "narwhal.cli.operator", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**clean, **(env or {})},
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    return Cli(proc.returncode or 0, out.decode(), err.decode())
