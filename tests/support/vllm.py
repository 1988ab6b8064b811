"""Real vLLM (the CPU build) processes for end-to-end tests of the vllm adapter.

`vllm_install` installs (once, cached under ~/.cache/narwhal) vLLM's CPU build, NIXL and a small
Gemma 3 270M model with `scripts/get-vllm.sh`. `VllmServer` runs one OpenAI server on loopback
ports it picks, with prefix caching, KV events on ZMQ (PUB bound on `tcp://*:{events_port}`,
replay ROUTER on `tcp://127.0.0.1:{replay_port}`) and, unless told otherwise, the NixlConnector
with a CPU KV buffer, so two of them hand a prompt's KV over from prefill to decode.
`prime_handoff` makes a pair's first NIXL handshake before a test depends on it.
"""

from __future__ import annotations

import contextlib
import json
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
class VllmInstall:
    python: Path  # the venv's interpreter: `python -m vllm.entrypoints.openai.api_server`
    model: Path  # a Hugging Face-format directory, tokenizer included
    tokenizer: Path


@pytest.fixture(scope="session")
def vllm() -> VllmInstall:
    """vLLM and its model, for every vLLM test of the session."""
    return vllm_install()


def vllm_install() -> VllmInstall:
    """Install or reuse vLLM and the model (~5 minutes the first time on a machine)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "get-vllm.sh")],
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
    ).stdout
    paths = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return VllmInstall(
        Path(paths["VLLM_PYTHON"]), Path(paths["VLLM_MODEL"]), Path(paths["VLLM_TOKENIZER"])
    )


class VllmServer:
    """One vLLM OpenAI server on the CPU. Its output goes to `log_path`."""

    def __init__(
        self,
        install: VllmInstall,
        log_path: Path,
        *,
        kv_role: str | None = "kv_both",
        kv_cache_bytes: int = 256 << 20,
        start_timeout_s: float = 600.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.install = install
        self.log_path = log_path
        self.kv_role = kv_role
        self.kv_cache_bytes = kv_cache_bytes
        self.start_timeout_s = start_timeout_s
        self.extra_args = extra_args
        # Bound a minute into vLLM's start: ports no outgoing connection can take meanwhile.
        self.port = free_port()
        self.events_port = free_port()
        self.replay_port = free_port()
        self.side_channel_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events_url = f"tcp://127.0.0.1:{self.events_port}"
        self.replay_url = f"tcp://127.0.0.1:{self.replay_port}"
        self.tmp_dir = log_path.parent / f"{log_path.stem}-tmp"
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # "*" makes vLLM bind the PUB socket; an address without it makes vLLM connect.
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": self.replay_url,
        }
        cmd = [
            str(self.install.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.install.model),
            "--served-model-name", MODEL_ALIAS,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", "float32",  # bf16 made near-ties that PD and unified broke differently
            "--max-model-len", "1024",
            "--max-num-seqs", "4",
            "--block-size", "16",
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--enforce-eager",  # no torch.compile: start-up in seconds, not minutes
            "--enable-prefix-caching",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        if self.kv_role is not None:
            transfer = {
                "kv_connector": "NixlConnector",
                "kv_role": self.kv_role,  # kv_producer (prefill) or kv_consumer (decode)
                "kv_buffer_device": "cpu",
            }
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_HOST_IP": "127.0.0.1",  # vLLM's own sockets between its processes
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # two servers share 2 cores with the tests
            "OMP_NUM_THREADS": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache (AllBlocksCleared)
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            # vLLM's IPC sockets between its processes, which a killed server leaves behind.
            "TMPDIR": str(self.tmp_dir),
            "TRANSFORMERS_OFFLINE": "1",
        }

    def start(self) -> VllmServer:
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,  # its EngineCore and worker go with it on stop/kill
            )
        return self

    def wait_ready(self) -> None:
        """Poll `/v1/models` until it names the model (the engine is up), with a deadline."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if not self.running:
                raise AssertionError(f"vLLM on {self.url} exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as resp:
                    if resp.status == 200 and MODEL_ALIAS in resp.read().decode():
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise AssertionError(f"vLLM on {self.url} not ready in time:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)  # the session this server leads, and only it

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            self._proc.wait(timeout=30)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._proc is not None:
            self._signal_group(signal.SIGKILL)  # a child the server left behind


PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _post(url: str, body: dict[str, object], timeout_s: float) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def prime_handoff(prefill: VllmServer, decode: VllmServer, attempts: int = 3) -> int:
    """One warm-up completion on each server, then direct prefill->decode handoffs until one
    succeeds; returns how many it took. The decode's first handshake with a prefill waits at
    most 5 s for its answer (fixed in vLLM 0.32's NixlConnector): right after start-up on 2
    loaded cores that has timed out (`zmq.error.Again`, the request a 500)."""
    body: dict[str, object] = {"model": MODEL_ALIAS, "prompt": "Warm up.", "temperature": 0}
    for server in (prefill, decode):
        status, answer = _post(server.url + "/v1/completions", {**body, "max_tokens": 1}, 120)
        assert status == 200, answer
    for attempt in range(1, attempts + 1):
        status, first = _post(
            prefill.url + "/v1/completions",
            {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV_PARAMS},
            120,
        )
        assert status == 200, first
        decode_body = {**body, "max_tokens": 2, "kv_transfer_params": first["kv_transfer_params"]}
        status, answer = _post(decode.url + "/v1/completions", decode_body, 120)
        if status == 200:
            return attempt
    raise AssertionError(f"no prefill->decode handoff in {attempts} attempts: {answer}")
