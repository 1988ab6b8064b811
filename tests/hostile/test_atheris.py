"""The HTTP/1 connection (parser shell and state machine) under coverage-guided fuzzing:
`tests/hostile/atheris_h1.py` run by atheris (libFuzzer) for `SECONDS`, in a subprocess
(libFuzzer ends its process). Any exception out of the connection, a 5xx, a malformed answer,
a write after the close or an oversized body reaching a handler is a crash: the input is kept
under `tmp_path` and its bytes shown."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 30


@pytest.mark.slow
def test_the_connection_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    if platform.machine() != "x86_64":
        pytest.skip("atheris is installed on x86_64 only (its wheels; pyproject.toml)")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    argv = [sys.executable, "-m", "tests.hostile.atheris_h1", f"-max_total_time={SECONDS}",
            "-seed=1", f"-artifact_prefix={tmp_path}/", str(corpus)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=SECONDS + 120)
    crashes = sorted(tmp_path.glob("crash-*"))
    shown = "\n".join(repr(c.read_bytes()[:400]) for c in crashes)
    assert done.returncode == 0, done.stderr[-4000:] + "\n" + shown
    runs = re.search(r"Done (\d+) runs", done.stderr)
    assert runs is not None, done.stderr[-2000:]
    assert int(runs[1]) > 10_000, done.stderr[-2000:]  # it ran, not just started
    assert len(list(corpus.iterdir())) > 3  # it found inputs beyond the seeds
