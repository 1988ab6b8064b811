"""The benchmark's own virtualenv (bench/.venv): the peer routers, py-spy, uvloop and httptools.

Kept apart from the project's .venv so that the peers' dependencies never touch Narwhal's pins.
Each package is installed on its own, so one that cannot be installed is reported by name
(with pip's last words) while the others still run.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = {
    "vllm-router": "vllm-router==0.1.17",
    "sglang-router": "sglang-router==0.3.2",
    "py-spy": "py-spy==0.4.3",
    "uvloop": "uvloop==0.23.0",
    "aiohttp": "aiohttp==3.14.5",  # the load generator's client, same pin as Narwhal's
    # bench.floor_raw's HTTP parser (llhttp); lent with uvloop to the project's interpreter
    # by bench.uvrun, never installed into the project's .venv
    "httptools": "httptools==0.9.0",
    "granian": "granian==2.8.7",  # bench.floor_granian's server (it runs in this venv)
}
VENV = Path(__file__).resolve().parent / ".venv"


@dataclass(slots=True)
class BenchVenv:
    path: Path = VENV
    installed: dict[str, str] = field(default_factory=dict)  # name -> requirement
    failed: dict[str, str] = field(default_factory=dict)  # name -> reason

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    @property
    def ready(self) -> bool:
        return self.python.exists()

    def has(self, name: str) -> bool:
        return name in self.installed

    @property
    def stamp(self) -> Path:
        return self.path / ".bench-installed.json"


async def _run(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")


def _write(path: Path, text: str) -> None:
    path.write_text(text)


async def ensure_venv(log: Path) -> BenchVenv:
    """Create bench/.venv and install what is missing; never raises for a package."""
    venv = BenchVenv()
    done: dict[str, str] = {}
    if venv.stamp.exists():
        done = json.loads(venv.stamp.read_text())
    if not venv.ready:
        code, out = await _run(sys.executable, "-m", "venv", str(venv.path))
        _write(log, out)
        if code:
            venv.failed = dict.fromkeys(PACKAGES, f"cannot create the virtualenv: {out[-300:]}")
            return venv
    with log.open("a") as out_file:
        for name, requirement in PACKAGES.items():
            if done.get(name) == requirement:
                venv.installed[name] = requirement
                continue
            print(f"bench: installing {requirement} into {venv.path}", file=sys.stderr)
            code, out = await _run(str(venv.python), "-m", "pip", "install", "--quiet", requirement)
            out_file.write(f"$ pip install {requirement}\n{out}\n")
            if code:
                lines = [x for x in out.splitlines() if x.strip() and "is ignored" not in x]
                venv.failed[name] = " / ".join(lines[-3:])[:400] or f"pip exit {code}"
            else:
                venv.installed[name] = requirement
    venv.stamp.write_text(json.dumps(venv.installed, indent=1))
    return venv
