"""deploy/install.sh, as the image build runs it, in a fresh virtualenv.

The build stage of deploy/Dockerfile is replayed outside Docker: its COPY instructions fill a
temporary build context (only what they copy, so a file the install needs but the Dockerfile
does not copy fails here), and its install RUN line runs as written, with the image's paths
(/opt/narwhal, /src) mapped to the test's virtualenv and context. The console scripts must
then work from that virtualenv, and the installed package must carry its data files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.dockerfile import REPO, parse

pytestmark = pytest.mark.slow  # a venv and a pip install from PyPI: 20-40 s


def _build_context(dest: Path) -> Path:
    """Replay the build stage's COPY lines into `dest` (standing for its WORKDIR)."""
    (build,) = [s for s in parse().stages if s.name == "build"]
    workdir = build.last("WORKDIR")
    assert workdir is not None
    for copy in build.all("COPY"):
        *sources, target = copy.words()
        for src in sources:
            origin = REPO / src
            into = dest / target.removeprefix(workdir.args).lstrip("./").lstrip("/")
            if target.endswith("/") or len(sources) > 1:
                into = into / origin.name
            into.parent.mkdir(parents=True, exist_ok=True)
            if origin.is_dir():
                shutil.copytree(origin, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(origin, into)
    return dest


def _install_line() -> str:
    runs = [i.args for s in parse().stages for i in s.all("RUN") if "deploy/install.sh" in i.args]
    (line,) = runs
    return line


def test_install_sh_in_a_clean_venv_gives_working_console_scripts(tmp_path: Path) -> None:
    context = _build_context(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)

    # The Dockerfile's own line, with the image's paths mapped to this test's.
    line = _install_line().replace("/opt/narwhal", str(venv)).replace(" /src", f" {context}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    done = subprocess.run(
        ["sh", "-c", line],
        cwd=context,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    bin_dir = venv / "bin"
    for script in ("narwhal-serve", "narwhal"):
        helped = subprocess.run(
            [str(bin_dir / script), "--help"], capture_output=True, text=True, timeout=60
        )
        assert helped.returncode == 0, helped.stderr
        assert "usage:" in helped.stdout
    checked = subprocess.run(
        [str(bin_dir / "narwhal-serve"), "--check-config", str(REPO / "examples" / "narwhal.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("config OK")

    # A real (not editable) install, with the package's data files (dashboard, schema).
    located = subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import narwhal, os; print(os.path.dirname(narwhal.__file__))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
    )
    installed = Path(located.stdout.strip())
    assert installed.is_relative_to(venv), installed
    source = REPO / "src" / "narwhal"
    data = [p.relative_to(source) for p in source.rglob("*") if p.suffix in {".json", ".html"}]
    assert data
    missing = [str(p) for p in data if not (installed / p).is_file()]
    assert missing == []

    # The tracing extra ships in the image, and every dependency is at its locked version.
    frozen = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    installed_pins = {_pin(line) for line in frozen.splitlines() if "==" in line}
    locked = REPO / "requirements" / "runtime.lock"
    locked_pins = {_pin(line) for line in locked.read_text().splitlines() if "==" in line}
    assert {p for p in installed_pins if not p.startswith("narwhal-router==")} == locked_pins
    assert any(p.startswith("opentelemetry-sdk==") for p in installed_pins)


def _pin(line: str) -> str:
    """`Name_x==1.0` as `name-x==1.0` (pip freeze and the lock spell names differently)."""
    name, version = line.split("==", 1)
    return f"{name.strip().lower().replace('_', '-')}=={version.strip()}"
