"""The machine and software a run measured: for the report's "machine" section."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.venv import BenchVenv


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 1024 / 1024, 1)
    return 0.0


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, check=False
        )
    except OSError:
        return "unknown"
    return out.stdout.strip()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe(venv: BenchVenv) -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_gib": _mem_total_gib(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "narwhal": _version("narwhal-router"),
        "aiohttp": _version("aiohttp"),
        "peers": dict(venv.installed),
        "peer_failures": dict(venv.failed),
        "git_commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "src_modified": bool(_git("status", "--porcelain", "--", "src")),
    }
