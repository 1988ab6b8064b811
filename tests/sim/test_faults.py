"""Every fault kind, observed from outside the process as a router would see it."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from typing import Any

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.sim_process import SimFactory, SimProcess

from .helpers import complete, connect_refused, decode_body, post, prefill_body, sse_data

BODY: dict[str, Any] = {"prompt": "one two three four five", "max_tokens": 5}
STREAM = BODY | {"stream": True, "stream_options": {"include_usage": True}}


def completion_status(sim: SimProcess, body: dict[str, Any] = BODY) -> int:
    return post(sim, "/v1/completions", body)[0]


async def next_event(resp: aiohttp.ClientResponse, timeout_s: float = 5.0) -> bytes:
    async with asyncio.timeout(timeout_s):
        return await resp.content.readuntil(b"\n\n")


def test_the_fault_api_adds_lists_and_removes(unified: SimProcess) -> None:
    fault = unified.add_fault({"kind": "completion_status", "status": 503, "leg": "decode"})
    assert fault == {
        "id": fault["id"],
        "kind": "completion_status",
        "leg": "decode",
        "count": None,
        "probability": None,
        "status": 503,
        "fired": 0,
    }
    other = unified.add_fault({"kind": "no_done"})
    assert [f["id"] for f in unified.faults()] == [fault["id"], other["id"]]
    unified.remove_fault(fault["id"])
    assert unified.faults() == [other]
    assert unified.http("DELETE", f"/sim/faults/{fault['id']}")[0] == 404
    for bad in ({"kind": "completion_status"}, {"kind": "bogus"}, {"kind": "no_done", "x": 1}):
        status, raw = unified.http("POST", "/sim/faults", bad)
        assert status == 400, raw
    unified.clear_faults()
    assert unified.faults() == []


@pytest.mark.parametrize("status", [500, 503, 408, 429, 400])
def test_completion_status_answers_that_status(unified: SimProcess, status: int) -> None:
    unified.add_fault({"kind": "completion_status", "status": status})
    got, err = post(unified, "/v1/completions", BODY)
    assert got == status
    assert err["error"]["code"] == status
    assert post(unified, "/v1/chat/completions", {"messages": []})[0] == status


def test_count_limits_firings(unified: SimProcess) -> None:
    fault = unified.add_fault({"kind": "completion_status", "status": 503, "count": 2})
    assert [completion_status(unified) for _ in range(3)] == [503, 503, 200]
    assert unified.faults() == [fault | {"fired": 2}]
    assert 'narwhal_sim_faults_fired_total{kind="completion_status"}' in unified.metrics()


def test_leg_targets_one_leg(unified: SimProcess) -> None:
    unified.add_fault({"kind": "completion_status", "status": 500, "leg": "prefill"})
    assert completion_status(unified) == 200
    assert completion_status(unified, prefill_body(BODY)) == 500


def test_probability_fires_some_of_the_time(unified: SimProcess) -> None:
    unified.add_fault({"kind": "completion_status", "status": 500, "probability": 0.5})
    statuses = [completion_status(unified) for _ in range(40)]
    assert 0 < statuses.count(500) < 40
    assert unified.faults()[0]["fired"] == statuses.count(500)


def test_reset_connections_drops_the_connection_without_an_answer(unified: SimProcess) -> None:
    unified.add_fault({"kind": "reset_connections", "count": 1})
    conn = http.client.HTTPConnection("127.0.0.1", unified.port, timeout=5)
    with pytest.raises(ConnectionError):
        conn.request("POST", "/v1/completions", json.dumps(BODY))
        conn.getresponse()
    conn.close()
    assert completion_status(unified) == 200


def test_health_status_and_health_hang(unified: SimProcess) -> None:
    unified.add_fault({"kind": "health_status", "status": 503})
    assert unified.http("GET", "/health")[0] == 503
    unified.clear_faults()
    unified.add_fault({"kind": "health_hang"})
    with pytest.raises(TimeoutError):
        unified.http("GET", "/health", timeout_s=0.3)
    unified.clear_faults()
    unified.add_fault({"kind": "health_hang", "delay_s": 0.3})
    start = time.monotonic()
    assert unified.http("GET", "/health") == (200, b"")
    assert time.monotonic() - start >= 0.3


async def test_stall_first_token_withholds_every_byte(unified: SimProcess) -> None:
    unified.add_fault({"kind": "stall_first_token", "delay_s": 0.6})
    async with aiohttp.ClientSession() as session:
        for body in (STREAM, BODY):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await session.post(unified.url + "/v1/completions", json=body)
        start = time.monotonic()
        async with session.post(unified.url + "/v1/completions", json=STREAM) as resp:
            assert resp.status == 200
            assert time.monotonic() - start >= 0.6
            assert sse_data(await resp.read())[-1] == "[DONE]"


async def test_stall_mid_stream_goes_silent_after_n_tokens(unified: SimProcess) -> None:
    unified.add_fault({"kind": "stall_mid_stream", "after_tokens": 2, "delay_s": 1.0})
    async with (
        aiohttp.ClientSession() as session,
        session.post(unified.url + "/v1/completions", json=STREAM) as resp,
    ):
        assert resp.status == 200
        first_two = [await next_event(resp) for _ in range(2)]
        assert all(json.loads(e[6:])["choices"][0]["text"] for e in first_two)
        with pytest.raises(TimeoutError):
            await next_event(resp, timeout_s=0.3)
        rest = sse_data(await resp.read())
        assert len(rest) == 3 + 1 + 1  # tokens, usage, [DONE]
        assert rest[-1] == "[DONE]"


async def test_stall_mid_stream_forever(unified: SimProcess) -> None:
    unified.add_fault({"kind": "stall_mid_stream", "after_tokens": 1})
    async with (
        aiohttp.ClientSession() as session,
        session.post(unified.url + "/v1/completions", json=STREAM) as resp,
    ):
        await next_event(resp)
        with pytest.raises(TimeoutError):
            await next_event(resp, timeout_s=0.3)


def test_no_done_ends_the_stream_cleanly_without_the_marker(unified: SimProcess) -> None:
    unified.add_fault({"kind": "no_done"})
    status, raw = unified.http("POST", "/v1/completions", STREAM)
    assert status == 200
    events = sse_data(raw)
    assert "[DONE]" not in events
    assert json.loads(events[-1])["usage"]["completion_tokens"] == 5


def test_malformed_event_is_one_non_json_data_event(unified: SimProcess) -> None:
    unified.add_fault({"kind": "malformed_event"})
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    for path, body in (("/v1/completions", STREAM), ("/v1/chat/completions", chat)):
        events = sse_data(unified.http("POST", path, body)[1])
        bad = []
        for data in events[:-1]:
            try:
                json.loads(data)
            except ValueError:
                bad.append(data)
        assert len(bad) == 1
        assert events[-1] == "[DONE]"


def test_handoff_garbage_returns_params_of_the_wrong_types(unified: SimProcess) -> None:
    unified.add_fault({"kind": "handoff_garbage"})
    params = complete(unified, prefill_body(BODY))["kv_transfer_params"]
    assert params["remote_block_ids"] == "x"
    assert params["remote_port"] == "nope"
    assert complete(unified, BODY)["kv_transfer_params"] is None  # only prefill legs


def test_handoff_missing_returns_no_params_key(unified: SimProcess) -> None:
    unified.add_fault({"kind": "handoff_missing", "count": 1})
    answer = complete(unified, prefill_body(BODY))
    assert "kv_transfer_params" not in answer
    assert answer["choices"][0]["finish_reason"] == "length"
    assert isinstance(complete(unified, prefill_body(BODY))["kv_transfer_params"], dict)


def test_wrong_model_reports_another_model(unified: SimProcess) -> None:
    unified.add_fault({"kind": "wrong_model", "model": "imposter"})
    assert unified.get_json("/v1/models")["data"][0]["id"] == "imposter"
    assert complete(unified, BODY)["model"] == "imposter"
    events = sse_data(unified.http("POST", "/v1/completions", STREAM)[1])
    assert json.loads(events[0])["model"] == "imposter"


def test_slow_makes_completions_slower(sim_factory: SimFactory) -> None:
    sim = sim_factory("--ttft-per-token-ms", "10", "--itl-ms", "0")
    sim.add_fault({"kind": "slow", "factor": 10})
    start = time.monotonic()
    complete(sim, BODY)  # 5 prompt tokens: 50 ms, ten times over
    assert time.monotonic() - start >= 0.5


def test_restart_drops_the_kv_and_starts_a_newer_generation(sim_factory: SimFactory) -> None:
    prefill, decode = sim_factory.start_many([["--kv-role", "kv_producer"], []])
    before = prefill.process_start_time()
    params = complete(prefill, prefill_body(BODY))["kv_transfer_params"]
    fault = prefill.add_fault({"kind": "restart"})
    assert fault["fired"] == 1
    assert prefill.faults() == []
    assert prefill.process_start_time() > before
    assert prefill.metric("narwhal_sim_kv_handoffs_held") == 0
    status, err = post(decode, "/v1/completions", decode_body(BODY, params))
    assert status == 500
    assert "KV load failed" in err["error"]["message"]


async def test_refuse_connections_closes_the_port_then_reopens_it(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory()
    idle = socket.create_connection(("127.0.0.1", sim.port), timeout=5)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert idle.recv(4096).startswith(b"HTTP/1.1 200")
    sim.add_fault({"kind": "refuse_connections", "duration_s": 0.5})
    await eventually(lambda: connect_refused("127.0.0.1", sim.port), what="refused")
    assert idle.recv(4096) == b""  # the idle keep-alive connection was closed
    idle.close()
    await eventually(lambda: not connect_refused("127.0.0.1", sim.port), what="listening again")
    assert sim.http("GET", "/health")[0] == 200


async def test_refuse_connections_without_duration_lasts(sim_factory: SimFactory) -> None:
    sim = sim_factory()
    assert sim.add_fault({"kind": "refuse_connections"})["duration_s"] is None
    await eventually(lambda: connect_refused("127.0.0.1", sim.port), what="refused")
    assert sim.running
