"""wrk mode of the router-bound measurement (issue 32): wrk's output parsed (real outputs
captured from smoke runs on this machine), its request script, the mock engine's answers over a
real socket, Narwhal routing through two mock engines to the official openai client, and a
target that failed most requests staying visible in the report."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from bench import wrk
from bench.mock_engine import MockEngine
from bench.procs import free_port
from bench.report import router_wrk as report
from bench.report import targets
from bench.routers import Engines, RouterSpec, start_router
from bench.suites.router_wrk import broken, failed_row, medians, row

from narwhal.engine.vllm import Handoff, extract_handoff, parse_generation

MODEL = "mock-model"
EIGHT = "".join(f" w{i}" for i in range(8))

# wrk against one mock engine, non-streaming
WRK_JSON = """\
Running 2s test @ http://127.0.0.1:18124/v1/completions
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     0.86ms    0.90ms   9.03ms   92.64%
    Req/Sec    11.67k     3.24k   13.86k    75.00%
  Latency Distribution
     50%  573.00us
     75%  652.00us
     90%    1.17ms
     99%    5.06ms
  23233 requests in 2.00s, 9.78MB read
Requests/sec:  11598.58
Transfer/sec:      4.88MB
"""

# the same, streaming (a duration wrk rounds to 2.10s)
WRK_STREAM = """\
Running 2s test @ http://127.0.0.1:18124/v1/completions
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.82ms    1.59ms  10.80ms   84.81%
    Req/Sec     5.24k     1.23k    6.73k    47.62%
  Latency Distribution
     50%    1.26ms
     75%    2.34ms
     90%    4.20ms
     99%    7.68ms
  10955 requests in 2.10s, 17.64MB read
Requests/sec:   5208.77
Transfer/sec:      8.39MB
"""

# a path the mock does not serve (every answer a 404), the mock killed after 1 s
WRK_ERRORS = """\
Running 2s test @ http://127.0.0.1:18124/v1/nope
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.33ms    2.02ms  23.73ms   90.26%
    Req/Sec     6.99k     2.47k    9.72k    81.82%
  Latency Distribution
     50%  608.00us
     75%  831.00us
     90%    3.25ms
     99%   10.00ms
  7648 requests in 2.10s, 1.27MB read
  Socket errors: connect 0, read 8, write 53445, timeout 0
  Non-2xx or 3xx responses: 7648
Requests/sec:   3642.49
Transfer/sec:    618.94KB
"""

# a listener that accepts and never answers: nothing completes
WRK_NOTHING = """\
Running 2s test @ http://127.0.0.1:18125/v1/completions
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     0.00us    0.00us   0.00us    -nan%
    Req/Sec     0.00      0.00     0.00      -nan%
  Latency Distribution
     50%    0.00us
     75%    0.00us
     90%    0.00us
     99%    0.00us
  0 requests in 2.01s, 0.00B read
Requests/sec:      0.00
Transfer/sec:       0.00B
"""

# --- wrk's output ---------------------------------------------------------------------------


def test_a_clean_run_is_read_whole() -> None:
    r = wrk.parse_output(WRK_JSON)
    assert (r.requests, r.duration_s, r.rps) == (23233, 2.0, 11598.58)
    assert r.p50_ms == pytest.approx(0.573)
    assert (r.p90_ms, r.p99_ms) == (1.17, 5.06)
    assert (r.non_2xx, r.socket_errors, r.failed) == (0, 0, 0)
    assert not broken(r.requests, r.failed)


def test_a_streamed_run_with_a_rounded_duration() -> None:
    r = wrk.parse_output(WRK_STREAM)
    assert (r.requests, r.duration_s, r.rps) == (10955, 2.1, 5208.77)
    assert (r.p50_ms, r.p90_ms, r.p99_ms) == (1.26, 4.2, 7.68)


def test_error_statuses_and_socket_errors_are_counted_and_break_the_run() -> None:
    r = wrk.parse_output(WRK_ERRORS)
    assert (r.requests, r.non_2xx) == (7648, 7648)
    assert (r.connect_errors, r.read_errors, r.write_errors, r.timeouts) == (0, 8, 53445, 0)
    assert r.socket_errors == 53453
    assert r.failed == 7648 + 8  # statuses of 400+, and requests cut while being read
    assert broken(r.requests, r.failed)


def test_a_run_where_nothing_completed_has_no_latency_and_is_broken() -> None:
    r = wrk.parse_output(WRK_NOTHING)
    assert (r.requests, r.rps, r.failed) == (0, 0.0, 0)
    assert all(math.isnan(v) for v in (r.p50_ms, r.p90_ms, r.p99_ms))  # not 0.00us
    assert broken(r.requests, r.failed)


def test_what_is_not_wrk_output_with_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="not wrk output"):
        wrk.parse_output("unable to connect to 127.0.0.1:18124 Connection refused\n")
    without = "\n".join(line for line in WRK_JSON.splitlines() if "%  " not in line)
    with pytest.raises(ValueError, match="--latency"):
        wrk.parse_output(without)


def test_the_script_posts_the_body_in_a_string_the_body_cannot_close() -> None:
    doc = {"model": "m]]x]=]", "prompt": "a", "max_tokens": 8, "stream": True}
    text = wrk.script(doc)
    assert 'wrk.method = "POST"' in text
    assert 'wrk.headers["Content-Type"] = "application/json"' in text
    line = next(x for x in text.splitlines() if x.startswith("wrk.body = "))
    assert line.startswith("wrk.body = [==[") and line.endswith("]==]")
    assert json.loads(line.removeprefix("wrk.body = [==[").removesuffix("]==]")) == doc


def test_the_body_and_the_command() -> None:
    doc = wrk.body(MODEL, 32, 8, stream=False)
    assert len(doc["prompt"].split()) == 32
    assert (doc["model"], doc["max_tokens"], doc["stream"]) == (MODEL, 8, False)
    argv = wrk.argv("http://h/v1/completions", Path("s.lua"), 64, 5.0, 12.0)
    assert argv == [
        "wrk",
        "-t1",
        "-c64",
        "-d5s",
        "--latency",
        "--timeout",
        "12s",
        "-s",
        "s.lua",
        "http://h/v1/completions",
    ]


# --- the mock engine, over a real socket ---------------------------------------------------


async def _serve(engine: MockEngine) -> TestServer:
    server = TestServer(engine.app(), host="127.0.0.1", port=engine.port)
    await server.start_server()
    return server


@pytest.fixture
async def mock() -> AsyncIterator[tuple[str, MockEngine]]:
    engine = MockEngine(MODEL, free_port())
    server = await _serve(engine)
    try:
        yield f"http://127.0.0.1:{engine.port}", engine
    finally:
        await server.close()


async def _post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        return resp.status, await resp.text()


async def test_a_prefill_leg_gets_a_handoff_narwhal_can_read(
    mock: tuple[str, MockEngine],
) -> None:
    url, engine = mock
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 1, "stream": False}
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    status, text = await _post(url + "/v1/completions", body)
    assert status == 200
    doc = json.loads(text)
    assert doc["choices"][0]["text"] == " w0"
    assert doc["kv_transfer_params"]["do_remote_prefill"] is True
    assert isinstance(extract_handoff(doc), Handoff)
    assert engine.counts == {"/v1/completions prefill": 1}


async def test_a_decode_stream_sends_max_tokens_chunks_usage_then_done(
    mock: tuple[str, MockEngine],
) -> None:
    url, engine = mock
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 8, "stream": True}
    body["stream_options"] = {"include_usage": True}
    body["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": "x"}
    status, text = await _post(url + "/v1/completions", body)
    assert status == 200
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [c["choices"][0] for c in chunks if c["choices"]]
    assert len(tokens) == 8 and "".join(t["text"] for t in tokens) == EIGHT
    assert [t["finish_reason"] for t in tokens] == [None] * 7 + ["length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 11, "completion_tokens": 8}
    assert engine.counts == {"/v1/completions stream": 1}


async def test_the_openai_client_reads_the_mock_directly(mock: tuple[str, MockEngine]) -> None:
    url, _ = mock
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as client:
        done = await client.completions.create(model=MODEL, prompt="a b", max_tokens=8)
        assert done.choices[0].text == EIGHT and done.usage is not None
        assert done.usage.completion_tokens == 8
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == " w0 w1 w2"


async def test_the_probes_the_routers_send(mock: tuple[str, MockEngine]) -> None:
    url, engine = mock
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as r:
            assert r.status == 200
        async with s.get(url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
        async with s.get(url + "/metrics") as r:
            assert parse_generation(await r.read()) is not None  # Narwhal's generation
        async with s.post(url + "/tokenize", json={"prompt": "a"}) as r:
            assert r.status == 404
        async with s.get(url + "/mock/stats") as r:
            stats = await r.json()
    assert stats == engine.counts
    assert stats["/tokenize 404"] == 1 and stats["/v1/models get"] == 1


# --- Narwhal in front of two mocks ---------------------------------------------------------


async def test_narwhal_routes_a_completion_through_two_mock_engines(tmp_path: Path) -> None:
    prefill, decode = MockEngine(MODEL, free_port()), MockEngine(MODEL, free_port())
    servers = [await _serve(prefill), await _serve(decode)]
    engines = Engines(
        MODEL, [f"http://127.0.0.1:{prefill.port}"], [f"http://127.0.0.1:{decode.port}"]
    )
    (tmp_path / "logs").mkdir()
    spec = RouterSpec("narwhal-w1", "narwhal", workers=1)
    running = await start_router(spec, engines, tmp_path, None, 10.0)  # waits for /ready
    try:
        async with openai.AsyncOpenAI(
            base_url=running.url + "/v1", api_key="-", max_retries=0
        ) as client:
            done = await client.completions.create(model=MODEL, prompt="a b c", max_tokens=8)
            assert done.choices[0].text == EIGHT
            stream = await client.completions.create(
                model=MODEL, prompt="a b c", max_tokens=8, stream=True
            )
            assert "".join([c.choices[0].text async for c in stream if c.choices]) == EIGHT
    finally:
        await running.stop()
        for server in servers:
            await server.close()
    assert prefill.counts["/v1/completions prefill"] == 2
    assert decode.counts["/v1/completions json"] == 1
    assert decode.counts["/v1/completions stream"] == 1


# --- a target that failed stays visible ----------------------------------------------------


def _run(requests: int, non_2xx: int = 0, cpu_s: float = 0.02) -> wrk.WrkRun:
    r = wrk.WrkResult(requests, 5.0, requests / 5, non_2xx, 0, 0, 0, 0, 1.0, 2.0, 3.0)
    return wrk.WrkRun(r, cpu_s, ())


def _row(target: str, run: wrk.WrkRun, router_cpu_s: float) -> dict[str, Any]:
    roles = {"router": {"pid": 1, "cpu_s": router_cpu_s, "rss_kb": 0, "restarted": False}}
    asked = {"prefill": {"/v1/completions prefill": run.result.requests}, "decode": {}}
    engines = {"prefill": 0.1, "decode": 0.1}
    return row(target, "no", 64, 0, run, (router_cpu_s, roles), engines, asked)


def _suite(samples: list[dict[str, Any]], targets: list[str]) -> dict[str, Any]:
    return {
        "targets": targets,
        "medians": medians(samples, targets),
        "concurrency": [64],
        "max_tokens": 8,
        "prompt_words": 32,
        "run_s": 5.0,
        "warm_s": 1.0,
        "reps": 1,
        "wrk": {"version": "wrk 4.1.0", "argv": ["wrk", "-c64"]},
    }


def test_cpu_per_1k_requests_and_ratios_to_each_peer() -> None:
    targets = ["narwhal-w1", "vllm-router", "sglang-router"]
    samples = [
        _row("narwhal-w1", _run(2000), 1.0),  # 500 CPU-ms / 1k
        _row("vllm-router", _run(1000), 0.25),  # 250
        _row("sglang-router", _run(4000), 4.0),  # 1000
    ]
    suite = _suite(samples, targets)
    p = report.point(suite, "narwhal-w1", "no", 64)
    assert p is not None and p["router_cpu_ms_per_1k"] == pytest.approx(500.0)
    assert p["engines_cpu_ms_per_1k"] == pytest.approx(100.0)
    assert p["engine_requests_per_req"]["prefill"] == {"/v1/completions prefill": 1.0}
    assert report.cpu_ratio(suite, "narwhal-w1", "vllm-router", "no", 64) == pytest.approx(2.0)
    assert report.cpu_ratio(suite, "narwhal-w1", "sglang-router", "no", 64) == pytest.approx(0.5)
    text = report.render(suite)
    assert "| json | 64 | narwhal-w1 | 2.00x | 0.50x |" in text


def test_a_target_that_failed_most_requests_is_flagged_and_gets_no_ratio() -> None:
    targets = ["narwhal-w1", "vllm-router", "sglang-router"]
    samples = [
        _row("narwhal-w1", _run(2000), 1.0),
        _row("vllm-router", _run(1000, non_2xx=900), 0.05),
        failed_row("sglang-router", "no", 64, 0, "wrk exited 1: unable to connect"),
    ]
    suite = _suite(samples, targets)
    assert math.isnan(report.cpu_ratio(suite, "narwhal-w1", "vllm-router", "no", 64))
    assert math.isnan(report.cpu_ratio(suite, "narwhal-w1", "sglang-router", "no", 64))
    text = report.render(suite)
    assert "**1 of 1 runs broken**, 900 non-2xx of 1000" in text
    sglang = next(line for line in text.splitlines() if "| sglang-router |" in line)
    assert "**1 of 1 runs broken**" in sglang


def test_a_suite_that_could_not_run_says_why() -> None:
    assert report.render({"skipped": "wrk could not be installed"}) == (
        "Not run: wrk could not be installed."
    )


def test_targets_judge_narwhal_against_the_cheaper_peer_and_the_floor() -> None:
    targets_ = ["narwhal-wauto", "vllm-router", "sglang-router", "floor-raw"]
    samples = [
        _row("narwhal-wauto", _run(2000), 1.0),  # 500 CPU-ms / 1k
        _row("vllm-router", _run(1000), 0.6),  # 600
        _row("sglang-router", _run(1000), 0.4),  # 400: the cheaper peer
        _row("floor-raw", _run(1000), 0.1),  # 100
    ]
    suites = {"router_wrk": _suite(samples, targets_)}
    (peers, floor) = targets.router_wrk(suites)
    assert peers.met is False and "json c=64 1.25x sglang-router" in peers.measured
    assert "the interim 1.5x is met" in peers.measured
    assert floor.met is False and "json c=64 5.00x" in floor.measured
    assert report.behind(suites["router_wrk"]) == [
        "json c=64 under wrk: narwhal-wauto spends 1.25x sglang-router's CPU per request.",
        "json c=64 under wrk: narwhal-wauto spends 5.00x floor-raw's CPU per request "
        "(target 1.5x).",
    ]
    cheaper = [_row("narwhal-wauto", _run(2000), 0.6), *samples[1:]]  # 300: below both
    (peers, _) = targets.router_wrk({"router_wrk": _suite(cheaper, targets_)})
    assert peers.met is True
    assert targets.router_wrk({}) == []


def test_an_ab_pairs_each_round_with_its_base_twins_and_skips_broken_runs() -> None:
    def s(target: str, rep: int, cpu: float, broken: bool = False) -> dict[str, Any]:
        return {"target": target, "stream": "no", "c": 64, "rep": rep,
                "router_cpu_ms_per_1k": cpu, "broken": broken}  # fmt: skip

    suite = {
        "targets": ["narwhal-w1", "narwhal-w1@base", "vllm-router"],
        "medians": [{"target": "narwhal-w1", "stream": "no", "c": 64}],
        "samples": [
            s("narwhal-w1", 0, 90.0), s("narwhal-w1@base", 0, 100.0),
            s("narwhal-w1", 1, 110.0), s("narwhal-w1@base", 1, 100.0),
            s("narwhal-w1", 2, 80.0), s("narwhal-w1@base", 2, 100.0),
            s("narwhal-w1", 3, 10.0), s("narwhal-w1@base", 3, 100.0, broken=True),
            s("vllm-router", 0, 50.0),
        ],
    }  # fmt: skip
    (pair,) = report.ab_pairs(suite)
    assert (pair["target"], pair["stream"], pair["c"]) == ("narwhal-w1", "no", 64)
    assert pair["ratios"] == [0.9, 1.1, 0.8]
    assert pair["median"] == 0.9 and pair["below_1"] == 2
