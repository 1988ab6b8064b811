"""The `narwhal-sim` command: the listening line, clean signals, startup faults, the fleet,
bench, and refusals (exit 2 for bad arguments, 1 for an engine that cannot start)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import pytest

import narwhal
from narwhal.sim.fleet import check_layout, fleet_specs
from tests.support.http import metric_sum
from tests.support.poll import eventually
from tests.support.ports import free_port
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
    """A port P with P, P+100 free, both outside the kernel's ephemeral range (a port the
    kernel picked could become another connection's local end before the fleet binds it: CI
    lost a run to that, the fleet exiting before its banner)."""
    return free_port(span=100)


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_the_fleet_starts_and_stops_its_engines(stop: str) -> None:
    base = _free_base_port()
    cmd = [sys.executable, "-m", "narwhal.sim.cli", "fleet", "--prefill", "1", "--decode", "1"]
    cmd += ["--base-port", str(base), "--itl-ms", "0"]
    # Its own process group, as in a terminal: Ctrl-C sends SIGINT to the fleet and its engines.
    fleet = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert fleet.stdout is not None
        lines = [fleet.stdout.readline().strip() for _ in range(3)]
        if "" in lines:  # it ended before its banner: say why
            _, stderr = fleet.communicate(timeout=30)
            raise AssertionError(f"the fleet ended ({fleet.returncode}): {lines} {stderr}")
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
        if stop == "sigterm":
            fleet.send_signal(signal.SIGTERM)
        else:
            os.killpg(fleet.pid, signal.SIGINT)
        _, stderr = fleet.communicate(timeout=30)
        assert fleet.returncode == 0, stderr
        assert "Traceback" not in stderr, stderr
        assert connect_refused("127.0.0.1", base)
        assert connect_refused("127.0.0.1", base + 100)
    finally:
        if fleet.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(fleet.pid, signal.SIGKILL)
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


# --- bench ---------------------------------------------------------------------------------------

_SUMMARY = re.compile(
    r"^(\d+) requests \((\d+) errors\) in ([\d.]+) s at concurrency (\d+): (\d+) requests/s$"
)


@pytest.mark.parametrize("stream", [False, True])
def test_bench_measures_an_engine(sim_factory: SimFactory, stream: bool) -> None:
    sim = sim_factory("--itl-ms", "0", "--ttft-per-token-ms", "0")
    cmd = [sys.executable, "-m", "narwhal.sim.cli", "bench", "--url", sim.url]
    cmd += ["--concurrency", "4", "--duration-s", "1", "--max-tokens", "4"]
    cmd += ["--stream"] if stream else []
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    match = _SUMMARY.match(result.stdout.strip())
    assert match, result.stdout
    requests, errors, _elapsed, concurrency, rate = match.groups()
    assert (int(errors), int(concurrency)) == (0, 4)
    assert int(requests) > 0 and int(rate) > 0, result.stdout
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in sim.metrics().splitlines()
        if line.startswith("narwhal_sim_requests_total{")
    )
    assert served >= int(requests)  # the engine saw every request bench counted


def test_bench_s_shared_prefix_workload_is_mostly_cached_prefixes(sim_factory: SimFactory) -> None:
    """Two preambles of 100 words, each request one of them and an 8-word question: an
    engine that caches prefixes computes little more than the questions."""
    sim = sim_factory("--itl-ms", "0", "--ttft-per-token-ms", "0", "--kv-blocks", "512")
    cmd = [sys.executable, "-m", "narwhal.sim.cli", "bench", "--url", sim.url, "--seed", "7"]
    cmd += ["--workload", "shared-prefix", "--groups", "2", "--prefix-words", "100"]
    cmd += ["--concurrency", "2", "--duration-s", "1", "--max-tokens", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    match = _SUMMARY.match(result.stdout.strip())
    assert match and int(match[1]) > 2 and int(match[2]) == 0, result.stdout
    metrics = sim.metrics()
    queries = metric_sum(metrics, "vllm:prefix_cache_queries_total")
    hits = metric_sum(metrics, "vllm:prefix_cache_hits_total")
    assert queries > 0 and hits / queries > 0.75, (hits, queries)


# --- refusals: exit 2 for bad arguments, 1 for an engine that cannot start -----------------------


def sim_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal.sim.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        pytest.param(["serve", "--port", "70000"], "--port", id="port-out-of-range"),
        pytest.param(["serve", "--port", "-1"], "--port", id="negative-port"),
        pytest.param(["serve", "--kv-ttl-s", "-1"], "--kv-ttl-s", id="negative-kv-ttl"),
        pytest.param(["serve", "--kv-ttl-s", "nan"], "--kv-ttl-s", id="nan-kv-ttl"),
        pytest.param(["serve", "--max-concurrency", "0"], "--max-concurrency", id="no-concurrency"),
        pytest.param(["serve", "--itl-ms", "-2"], "--itl-ms", id="negative-itl"),
        pytest.param(["serve", "--kv-load-timeout-s", "0"], "--kv-load-timeout-s",
                     id="zero-load-timeout"),
        pytest.param(["serve", "--max-model-len", "0"], "--max-model-len", id="zero-model-len"),
        pytest.param(["fleet", "--prefill", "-1"], "--prefill", id="negative-prefill"),
        pytest.param(["fleet", "--decode", "x"], "--decode", id="decode-not-a-number"),
        pytest.param(["fleet", "--prefill", "0", "--decode", "0"], "--prefill", id="empty-fleet"),
        pytest.param(["fleet", "--prefill", "101"], "--prefill", id="prefill-reaches-decode"),
        pytest.param(["fleet", "--base-port", "65500"], "--base-port", id="ports-past-65535"),
        pytest.param(["fleet", "--base-port", "0"], "--base-port", id="base-port-zero"),
        pytest.param(["fleet", "--max-concurrency", "0"], "--max-concurrency",
                     id="fleet-engine-option"),
        pytest.param(["fleet", "--port", "9001"], "--port", id="fleet-sets-the-port"),
        pytest.param(["fleet", "--role=decode"], "--role", id="fleet-sets-the-role"),
        pytest.param(["bench", "--url", "http://127.0.0.1:1", "--concurrency", "0"],
                     "--concurrency", id="bench-no-concurrency"),
        pytest.param(["bench", "--url", "http://127.0.0.1:1", "--duration-s", "-1"],
                     "--duration-s", id="bench-negative-duration"),
        pytest.param(["bench", "--url", "127.0.0.1:9001"], "--url", id="bench-url-no-scheme"),
        pytest.param(["serve", "--log-level", "LOUD"], "--log-level", id="log-level"),
        pytest.param(["fleet", "--log-level", "LOUD"], "--log-level", id="fleet-log-level"),
        pytest.param(["serve", "--seed", "x"], "--seed", id="seed-not-a-number"),
        pytest.param(["serve", "--kv-load-failure-policy", "x"], "--kv-load-failure-policy",
                     id="not-a-choice"),
    ],
)  # fmt: skip
def test_an_out_of_range_option_is_a_usage_error(args: list[str], named: str) -> None:
    result = sim_cli(*args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    (error,) = result.stderr.splitlines()  # one line: no usage block
    assert error.startswith(f"narwhal-sim {args[0]}: error: "), result.stderr
    assert named in error, error


@pytest.mark.parametrize("args", [["--version"], ["serve", "--version"]])
def test_version_prints_the_installed_distribution_version(args: list[str]) -> None:
    result = sim_cli(*args)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"narwhal-sim {narwhal.version()}\n"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port with a listener on it (and, for a fleet, its decode port free)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", _free_base_port()))
        sock.listen()
        yield sock.getsockname()[1]


def start_up_failure(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.splitlines()


def test_a_busy_port_is_a_one_line_start_up_failure(busy_port: int) -> None:
    lines = start_up_failure(sim_cli("serve", "--port", str(busy_port)))
    assert len(lines) == 1, lines
    assert lines[0].startswith("narwhal-sim: start-up failed: "), lines
    assert str(busy_port) in lines[0] and "in use" in lines[0], lines


def test_a_host_that_does_not_resolve_is_a_start_up_failure() -> None:
    lines = start_up_failure(sim_cli("serve", "--port", "0", "--host", "nowhere.invalid"))
    assert lines == [lines[0]] and lines[0].startswith(
        "narwhal-sim: start-up failed: --host nowhere.invalid: "
    ), lines


@pytest.mark.slow
def test_a_fleet_with_a_busy_port_stops_and_names_the_engine(busy_port: int) -> None:
    result = sim_cli("fleet", "--prefill", "1", "--decode", "1", "--base-port", str(busy_port))
    lines = start_up_failure(result)
    assert f"narwhal-sim fleet: an engine did not start: prefill-0 (port {busy_port}) " in (
        result.stderr
    ), lines
    assert any(line.startswith("narwhal-sim: start-up failed: ") for line in lines), lines
    # The decode engine that did start was stopped with the fleet.
    assert connect_refused("127.0.0.1", busy_port + 100)


# --- the fleet's port layout (pure) --------------------------------------------------------------


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (100, 3), (0, 2), (3, 0), (100, 100)])
def test_fleet_ports_never_collide(prefill: int, decode: int) -> None:
    assert check_layout(prefill, decode, 9001) is None
    ports = [spec.port for spec in fleet_specs(prefill, decode, 9001)]
    assert len(ports) == len(set(ports)) == prefill + decode
    assert all(1 <= port <= 65535 for port in ports)


@pytest.mark.parametrize(
    ("prefill", "decode", "base_port", "named"),
    [(101, 1, 9001, "--prefill"), (1, 1, 65436, "--base-port"), (2, 0, 65535, "--base-port"),
     (0, 0, 9001, "--prefill"), (-1, 1, 9001, "--prefill")],
)  # fmt: skip
def test_fleet_layouts_that_cannot_work_are_refused(
    prefill: int, decode: int, base_port: int, named: str
) -> None:
    problem = check_layout(prefill, decode, base_port)
    assert problem is not None and problem.startswith(named), problem
    with pytest.raises(ValueError, match=re.escape(problem)):
        fleet_specs(prefill, decode, base_port)
