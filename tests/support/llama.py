"""Real llama.cpp `llama-server` processes for end-to-end tests of the llamacpp adapter.

`llama_binaries` builds (once, cached under ~/.cache/narwhal) `llama-server` and fetches the
Gemma 3 270M model with `scripts/get-llama-server.sh`. `LlamaServer` runs one server on a
fixed loopback port so it can be killed and restarted on the same address.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
MODEL_ALIAS = "demo-model"


@dataclass(frozen=True)
class LlamaBinaries:
    server: Path
    model: Path


@pytest.fixture(scope="session")
def bins() -> LlamaBinaries:
    """llama-server and its model, for every llama test of the session."""
    return llama_binaries()


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `--slot-save-path` a module's servers share."""
    return tmp_path_factory.mktemp("slots")


def llama_binaries() -> LlamaBinaries:
    """Build or reuse llama-server and the model (minutes the first time on a machine)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "get-llama-server.sh")],
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
    ).stdout
    paths = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return LlamaBinaries(Path(paths["LLAMA_SERVER"]), Path(paths["LLAMA_MODEL"]))


class LlamaServer:
    """One llama-server: `--slot-save-path slot_dir`, `--swa-full` unless told otherwise."""

    def __init__(
        self,
        bins: LlamaBinaries,
        slot_dir: Path,
        *,
        swa_full: bool = True,
        parallel: int = 2,
        start_timeout_s: float = 120.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.bins = bins
        self.extra_args = extra_args
        self.slot_dir = slot_dir
        self.swa_full = swa_full
        self.parallel = parallel
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LlamaServer:
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(self.bins.server),
            "-m", str(self.bins.model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--alias", MODEL_ALIAS,
            "--slot-save-path", str(self.slot_dir),
            "-np", str(self.parallel),
            "-c", str(2048 * self.parallel),
            "-t", "1",
        ]  # fmt: skip
        if self.swa_full:
            cmd.append("--swa-full")
        cmd.extend(self.extra_args)
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        """Poll `/health` until 200 (the model is loaded), with a deadline."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            assert self._proc is not None and self._proc.poll() is None, "llama-server exited"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise AssertionError(f"llama-server on {self.url} not healthy in time")
            time.sleep(0.05)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
