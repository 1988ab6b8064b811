"""`make demo-real` (scripts/demo-real.sh) as a real process group: the router in front of
one prefill and one decode llama-server serves a PD completion, and SIGINT stops them all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

import openai
import pytest

from tests.support.llama import REPO, llama_binaries
from tests.support.poll import eventually, until_ready
from tests.support.ports import free_port

pytestmark = pytest.mark.llama


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def test_demo_real_serves_a_pd_completion_and_stops_on_sigint(tmp_path: Path) -> None:
    await asyncio.to_thread(llama_binaries)  # built once per machine, before the clock starts
    router, prefill, decode = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{router}"
    env = {
        **os.environ,
        "VENV": str(REPO / ".venv"),
        "LISTEN": f"127.0.0.1:{router}",
        "PREFILL_PORT": str(prefill),
        "DECODE_PORT": str(decode),
        "STATE": str(tmp_path / "demo-real"),
    }
    log_path = tmp_path / "demo-real.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            str(REPO / "scripts" / "demo-real.sh"),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal would give it
        )
    try:
        await until_ready(url + "/ready", proc, log_path, timeout_s=120, what="demo-real")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        try:
            answer = await client.completions.create(
                model="demo-model", prompt="Once upon a time", max_tokens=8, temperature=0
            )
        finally:
            await client.close()
        assert answer.choices[0].text.strip()
        # The decode server continued from the restored slot: one prompt token evaluated.
        assert answer.model_extra is not None and answer.model_extra["timings"]["prompt_n"] == 1

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal running `make demo-real`
        await asyncio.wait_for(proc.wait(), timeout=30)
        await eventually(
            lambda: not (_listening(router) or _listening(prefill) or _listening(decode)),
            timeout_s=10,
            what="router and both llama-servers stopped",
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout=10)
