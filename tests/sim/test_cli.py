"""The `narwhal-sim` command: the listening line, clean signals, startup faults, the fleet."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.sim_process import READY_PREFIX, SimFactory, SimProcess

from .helpers import complete, connect_refused, decode_body, post, prefill_body, text_of


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_sim_cleanly(sig: signal.Signals) -> None:
    sim = SimProcess().start()
    try:
        assert sim.url == f"http://127.0.0.1:{sim.port}"
        assert sim.http("GET", "/health")[0] == 200
        os.kill(sim.pid, sig)
        assert sim.wait() == 0
        assert connect_refused("127.0.0.1", sim.port)
    finally:
        sim.close()


async def test_a_stalled_request_does_not_hold_up_sigterm(sim_factory: SimFactory) -> None:
    sim = sim_factory("--fault", '{"kind": "stall_first_token"}')
    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(session.post(sim.url + "/v1/completions", json={"prompt": "x"}))
        await eventually(lambda: sim.get_json("/v1/loads")["running"] == 1, what="in flight")
        assert await asyncio.to_thread(sim.terminate, 3.0) == 0
        with pytest.raises(aiohttp.ClientError):
            await held


def test_faults_can_be_given_at_start(sim_factory: SimFactory) -> None:
    sim = sim_factory(
        "--fault",
        '{"kind": "completion_status", "status": 500, "count": 1}',
        "--fault",
        '{"kind": "wrong_model", "model": "m2"}',
    )
    assert [f["kind"] for f in sim.faults()] == ["completion_status", "wrong_model"]
    assert post(sim, "/v1/completions", {"prompt": "x"})[0] == 500
    assert complete(sim, {"prompt": "x"})["model"] == "m2"


def test_a_bad_fault_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "narwhal.sim.cli", "serve", "--port", "0", "--fault", "{}"],
        capture_output=True,
        timeout=20,
    )
    assert proc.returncode == 2
    assert b"--fault" in proc.stderr
    assert proc.stdout == b""


def test_restart_keeps_the_port_and_starts_a_newer_process(sim_factory: SimFactory) -> None:
    sim = sim_factory()
    port, pid, generation = sim.port, sim.pid, sim.process_start_time()
    sim.restart()
    assert (sim.port, sim.url) == (port, f"http://127.0.0.1:{port}")
    assert sim.pid != pid
    assert sim.process_start_time() > generation


def test_freeze_and_thaw(sim_factory: SimFactory) -> None:
    sim = sim_factory()
    sim.freeze()
    with pytest.raises(TimeoutError):
        sim.http("GET", "/health", timeout_s=0.3)
    sim.thaw()
    assert sim.http("GET", "/health")[0] == 200


def _free_base_port() -> int:
    """A port P with P, P+100 free (checked by binding; good enough for a test)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base: int = s.getsockname()[1]
        if base + 100 >= 65536:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 100))
            except OSError:
                continue
        return base
    raise RuntimeError("no free port pair")


@pytest.mark.slow
def test_the_fleet_starts_and_stops_its_engines() -> None:
    base = _free_base_port()
    cmd = [sys.executable, "-m", "narwhal.sim.cli", "fleet", "--prefill", "1", "--decode", "1"]
    cmd += ["--base-port", str(base), "--itl-ms", "0"]
    fleet = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert fleet.stdout is not None
        lines = [fleet.stdout.readline().strip() for _ in range(3)]
        assert lines == [
            f"narwhal-sim fleet: prefill prefill-0 http://127.0.0.1:{base}",
            f"narwhal-sim fleet: decode decode-0 http://127.0.0.1:{base + 100}",
            "narwhal-sim fleet ready",
        ]
        prefill, decode = SimProcess(), SimProcess()
        prefill.url, decode.url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 100}"
        assert prefill.get_json("/server_info")["kv_role"] == "kv_producer"
        assert decode.get_json("/server_info")["role"] == "decode"
        body = {"prompt": "a b c d e", "max_tokens": 4}
        handoff = complete(prefill, prefill_body(body))["kv_transfer_params"]
        answer = complete(decode, decode_body(body, handoff))
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 5
        assert len(text_of(answer).split()) == 4
        fleet.send_signal(signal.SIGTERM)
        assert fleet.wait(timeout=15) == 0
        assert connect_refused("127.0.0.1", base)
        assert connect_refused("127.0.0.1", base + 100)
    finally:
        if fleet.poll() is None:
            fleet.kill()
            fleet.wait()


def test_the_ready_line_is_the_only_stdout() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal.sim.cli", "--port", "0"],  # `serve` is the default
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(READY_PREFIX)
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        assert proc.stdout.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
