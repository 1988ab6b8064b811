"""scripts/test_processes.py: the suite runs one pytest process per idle CPU, at most two
(docs/testing.md)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test_processes.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("test_processes", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (usable CPUs, CPUs busy, processes)
CASES = [(2, 0.05, 2), (2, 1.0, 1), (2, 0.6, 1), (2, 0.4, 2), (2, 3.0, 1), (8, 2.1, 2), (8, 7.0, 1)]


@pytest.mark.parametrize(("cpus", "busy", "expected"), [*CASES, (1, 0.0, 1)])
def test_one_process_per_idle_cpu(cpus: int, busy: float, expected: int) -> None:
    assert _script().processes(cpus, busy) == expected


def test_a_busy_neighbour_on_the_only_cpu_is_measured() -> None:
    """A busy loop pinned to the script's one CPU reads as (nearly) that whole CPU busy."""
    cpu = min(os.sched_getaffinity(0))
    pin = lambda: os.sched_setaffinity(0, {cpu})  # noqa: E731
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        env = {k: v for k, v in os.environ.items() if k != "NARWHAL_TEST_PROCESSES"}
        done = subprocess.run(
            [sys.executable, str(SCRIPT)], preexec_fn=pin, env=env,
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    finally:
        hog.kill()
        hog.wait()
    assert done.stdout.strip() == "1"
    said = re.search(r"([\d.]+) of 1 CPUs busy", done.stderr)
    assert said, done.stderr
    assert float(said.group(1)) >= 0.5, done.stderr


def test_the_override_wins() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env={**os.environ, "NARWHAL_TEST_PROCESSES": "3"},
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "3"
