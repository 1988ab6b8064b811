"""Every failure path of the request path, classified (spec failure table) and answered right.

Faults are real: injected into narwhal-sim processes, or the process is killed, stopped
(SIGSTOP) or its port closed. Each test checks what the client got (single_attempt: 502/504
for an upstream failure, 503 + Retry-After for saturation), and what the router recorded
against which engine: `narwhal_engine_failures_total{engine,failure_class}` and
`narwhal_leg_outcomes_total{engine,leg,outcome}` from its `/metrics`, and the evidence streaks.
`recovery.eject_after` and `liveness_misses` are high so the engines stay in rotation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.engine.failures import FailureClass
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"
STAY = {"eject_after": 100, "liveness_misses": 100}
FAST = {"first_token_timeout_s": 1.0, "stream_idle_timeout_s": 0.5, "request_timeout_s": 5}
HEALTH_CLEARED = {"connection", "timeout", "overload"}  # a health 200 clears these streaks


@dataclass
class Sims:
    prefill: SimProcess
    decode: SimProcess


def _start_pair(factory: SimFactory, *extra: str) -> Sims:
    prefill, decode = factory.start_many(
        [["--role", "prefill", "--kv-role", "kv_producer", *extra],
         ["--role", "decode", "--kv-role", "kv_consumer", *extra]]
    )  # fmt: skip
    return Sims(prefill, decode)


@pytest.fixture(scope="module")
def shared() -> Iterator[Sims]:
    factory = SimFactory()
    try:
        yield _start_pair(factory)
    finally:
        factory.close()


async def _idle(sim: SimProcess) -> bool:
    return await asyncio.to_thread(sim.metric, "vllm:num_requests_running") == 0


@pytest.fixture
async def sims(shared: Sims) -> Sims:
    for sim in (shared.prefill, shared.decode):
        sim.clear_faults()
        await eventually(lambda s=sim: _idle(s), timeout_s=5, what="sim idle")
        sim.clear_requests()
    return shared


def _engines(sims: Sims) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": sims.prefill.url, "role": "prefill"},
        {"id": "d0", "url": sims.decode.url, "role": "decode"},
    ]


async def _router(start_router: StartRouter, sims: Sims, **serving: Any) -> RunningRouter:
    return await start_router(_engines(sims), recovery=STAY, serving={**FAST, **serving})


# ------------------------------------------------------------------------------- helpers


@dataclass
class Reply:
    status: int
    headers: Any
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[bytes]:
        return [e.strip() for e in self.body.split(b"\n\n") if e.strip()]


async def _complete(
    http: aiohttp.ClientSession, rr: RunningRouter, stream: bool, **extra: Any
) -> Reply:
    body = {"model": MODEL, "prompt": "a prompt that fails somewhere", "max_tokens": 8}
    body.update(extra)
    if stream:
        body["stream"] = True
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        return Reply(resp.status, resp.headers, await resp.read())


async def _metrics(http: aiohttp.ClientSession, rr: RunningRouter) -> list[Any]:
    async with http.get(rr.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list[Any], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _assert_openai_error(reply: Reply, status: int) -> dict[str, Any]:
    assert reply.status == status, reply.body
    assert reply.headers["Content-Type"].startswith("application/json")
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert set(error) >= {"message", "type", "param", "code"}
    if status == 503:
        assert int(reply.headers["Retry-After"]) >= 1
    return error


async def _assert_classified(
    http: aiohttp.ClientSession, rr: RunningRouter, engine: str, leg: str, cls: str
) -> None:
    """Exactly one failure recorded by the data plane: `cls`, against `engine`, on `leg`."""
    samples = await _metrics(http, rr)
    assert _value(samples, "narwhal_leg_outcomes_total", engine=engine, leg=leg, outcome=cls) == 1
    assert _value(samples, "narwhal_engine_failures_total", engine=engine, failure_class=cls) == 1
    assert _value(samples, "narwhal_engine_failures_total") == 1, "one failure in total"
    streaks = rr.router.fleet.get(engine).evidence
    if cls not in HEALTH_CLEARED:  # health sweeps run every 0.1 s and may clear the others
        assert streaks == {FailureClass(cls): 1}
    admin = {e["id"]: e for e in rr.router.engines_json()}
    assert all(e["in_flight"] == 0 for e in admin.values())
    assert all(e["ejected"] is False for e in admin.values())


# ------------------------------------------------------------- failures before any byte

PREFILL, DECODE = "prefill", "decode"
BEFORE_FIRST_BYTE = [
    # id, sim, fault, stream, client status, engine, leg, class
    ("prefill-500", PREFILL, {"kind": "completion_status", "status": 500}, False, 502,
     "p0", "inference_status"),
    ("prefill-503-stream", PREFILL, {"kind": "completion_status", "status": 503}, True, 502,
     "p0", "inference_status"),
    ("decode-500", DECODE, {"kind": "completion_status", "status": 500}, False, 502,
     "d0", "inference_status"),
    ("decode-502-stream", DECODE, {"kind": "completion_status", "status": 502}, True, 502,
     "d0", "inference_status"),
    ("prefill-429", PREFILL, {"kind": "completion_status", "status": 429}, False, 503,
     "p0", "overload"),
    ("prefill-408-stream", PREFILL, {"kind": "completion_status", "status": 408}, True, 503,
     "p0", "overload"),
    ("decode-429-stream", DECODE, {"kind": "completion_status", "status": 429}, True, 503,
     "d0", "overload"),
    ("decode-408", DECODE, {"kind": "completion_status", "status": 408}, False, 503,
     "d0", "overload"),
    ("handoff-garbage", PREFILL, {"kind": "handoff_garbage"}, False, 502, "p0", "kv_handoff"),
    ("handoff-garbage-stream", PREFILL, {"kind": "handoff_garbage"}, True, 502,
     "p0", "kv_handoff"),
    ("handoff-missing", PREFILL, {"kind": "handoff_missing"}, False, 502, "p0", "kv_handoff"),
    ("handoff-missing-stream", PREFILL, {"kind": "handoff_missing"}, True, 502,
     "p0", "kv_handoff"),
    ("decode-first-token-stall-stream", DECODE, {"kind": "stall_first_token"}, True, 504,
     "d0", "stream"),
    ("prefill-first-token-stall", PREFILL, {"kind": "stall_first_token"}, False, 504,
     "p0", "stream"),
    ("prefill-first-token-stall-stream", PREFILL, {"kind": "stall_first_token"}, True, 504,
     "p0", "stream"),
    ("decode-stall-non-stream", DECODE, {"kind": "stall_first_token"}, False, 504,
     "d0", "timeout"),
    ("prefill-reset", PREFILL, {"kind": "reset_connections"}, False, 502, "p0", "connection"),
    ("decode-reset-stream", DECODE, {"kind": "reset_connections"}, True, 502,
     "d0", "connection"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("which", "fault", "stream", "status", "engine", "cls"),
    [pytest.param(*case[1:], id=case[0]) for case in BEFORE_FIRST_BYTE],
)
async def test_failure_before_first_byte(
    sims: Sims,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    which: str,
    fault: dict[str, Any],
    stream: bool,
    status: int,
    engine: str,
    cls: str,
) -> None:
    # A non-streamed decode has no first-token deadline: its bound is the request's deadline.
    serving = {"request_timeout_s": 1.0} if cls == "timeout" else {}
    rr = await _router(start_router, sims, **serving)
    sim = sims.prefill if which == PREFILL else sims.decode
    sim.add_fault({**fault, "leg": which})

    reply = await _complete(http, rr, stream)

    _assert_openai_error(reply, status)
    await _assert_classified(http, rr, engine, which, cls)
    if which == PREFILL:
        assert sims.decode.requests() == [], "a failed prefill never reaches a decode engine"
    # Whatever the engine was still doing for us was abandoned (its connection closed).
    await eventually(lambda: _idle(sim), timeout_s=5, what="engine request aborted")


# --------------------------------------------------- failures after the first byte


def _assert_ends_with_error_event(reply: Reply) -> dict[str, Any]:
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    events = reply.events()
    assert b"data: [DONE]" not in events
    assert events[-1].startswith(b"data: ")
    error = json.loads(events[-1][len(b"data: ") :])["error"]
    assert error["message"] and error["type"] and error["code"] in (502, 504)
    return error


@pytest.mark.parametrize("after", [1, 3])
async def test_mid_stream_stall_ends_the_stream_with_an_error_event(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession, after: int
) -> None:
    rr = await _router(start_router, sims)
    sims.decode.add_fault({"kind": "stall_mid_stream", "leg": "decode", "after_tokens": after})
    started = time.monotonic()
    reply = await _complete(http, rr, True)
    elapsed = time.monotonic() - started

    _assert_ends_with_error_event(reply)
    tokens = [e for e in reply.events()[:-1] if b'"text"' in e]
    assert len(tokens) == after  # everything the engine sent before going silent was forwarded
    assert elapsed < FAST["first_token_timeout_s"] + 1.5  # ended by the idle deadline
    await _assert_classified(http, rr, "d0", "decode", "stream")
    await eventually(lambda: _idle(sims.decode), timeout_s=5, what="stalled decode aborted")


async def test_stream_without_done_is_an_invalid_termination(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(start_router, sims)
    sims.decode.add_fault({"kind": "no_done", "leg": "decode"})
    reply = await _complete(http, rr, True, max_tokens=5)
    _assert_ends_with_error_event(reply)
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in reply.events()[:-1]]
    assert len("".join(texts).split()) == 5  # all tokens arrived, only the marker was missing
    await _assert_classified(http, rr, "d0", "decode", "stream")


async def test_malformed_event_is_an_invalid_termination(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(start_router, sims)
    sims.decode.add_fault({"kind": "malformed_event", "leg": "decode"})
    reply = await _complete(http, rr, True)
    # The sim writes the first token and the malformed event together: the router may see
    # them in one read (nothing sent yet: a 502) or two (an error event ends the stream).
    if reply.status == 200:
        _assert_ends_with_error_event(reply)
        malformed = b'data: {"choices"'  # the sim's truncated event; never forwarded
        assert all(not e.startswith(malformed) for e in reply.events())
    else:
        _assert_openai_error(reply, 502)
    await _assert_classified(http, rr, "d0", "decode", "stream")


# ------------------------------------------------------------ engine 4xx: the client's


@pytest.mark.parametrize(
    ("which", "status", "stream"),
    [(PREFILL, 400, False), (PREFILL, 422, True), (DECODE, 400, True), (DECODE, 404, False)],
)
async def test_engine_4xx_is_passed_through_and_records_no_failure(
    sims: Sims,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    which: str,
    status: int,
    stream: bool,
) -> None:
    rr = await _router(start_router, sims)
    sim = sims.prefill if which == PREFILL else sims.decode
    sim.add_fault({"kind": "completion_status", "status": status, "leg": which})
    # What the engine itself answers on this leg, for comparison.
    kv = {"do_remote_decode": True} if which == PREFILL else {"do_remote_prefill": True}
    direct = {"model": MODEL, "prompt": "direct", "max_tokens": 1, "kv_transfer_params": kv}
    engine_status, engine_body = sim.http("POST", "/v1/completions", direct)
    assert engine_status == status
    sim.clear_requests()

    reply = await _complete(http, rr, stream)

    assert reply.status == status
    assert reply.json() == json.loads(engine_body)
    engine = "p0" if which == PREFILL else "d0"
    samples = await _metrics(http, rr)
    assert _value(samples, "narwhal_engine_failures_total") == 0
    assert _value(samples, "narwhal_leg_outcomes_total", engine=engine, outcome="client_4xx") == 1
    assert rr.router.fleet.get(engine).evidence == {}
    if which == PREFILL:
        assert sims.decode.requests() == []


async def test_engine_rejecting_a_field_is_the_clients_400(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A body the router accepts but the engine's validation refuses (`stop` of a wrong type)."""
    rr = await _router(start_router, sims)
    reply = await _complete(http, rr, False, stop=5)
    assert reply.status == 400
    assert "stop" in reply.json()["error"]["message"]
    assert _value(await _metrics(http, rr), "narwhal_engine_failures_total") == 0
    assert sims.decode.requests() == []


@pytest.mark.parametrize("which", [PREFILL, DECODE])
async def test_engine_4xx_clears_inference_status_evidence(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession, which: str
) -> None:
    rr = await _router(start_router, sims)
    sim = sims.prefill if which == PREFILL else sims.decode
    engine_id = "p0" if which == PREFILL else "d0"
    sim.add_fault({"kind": "completion_status", "status": 500, "leg": which, "count": 1})
    assert (await _complete(http, rr, False)).status == 502
    assert rr.router.fleet.get(engine_id).evidence == {FailureClass.INFERENCE_STATUS: 1}

    sim.add_fault({"kind": "completion_status", "status": 400, "leg": which, "count": 1})
    assert (await _complete(http, rr, False)).status == 400
    assert rr.router.fleet.get(engine_id).evidence == {}


# ------------------------------------------------ dead, stopped and closed engines


@pytest.mark.parametrize("how", ["kill", "refuse_connections"])
async def test_unreachable_prefill_is_a_connection_failure(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, how: str
) -> None:
    sims = _start_pair(sim_factory)
    rr = await _router(start_router, sims)
    if how == "kill":
        sims.prefill.kill()
    else:  # the process lives on, its port is closed
        sims.prefill.add_fault({"kind": "refuse_connections"})

    for stream in (False, True):
        _assert_openai_error(await _complete(http, rr, stream), 502)

    samples = await _metrics(http, rr)
    leg = _value(samples, "narwhal_leg_outcomes_total", engine="p0", leg="prefill")
    assert leg == 2
    assert leg == _value(
        samples, "narwhal_leg_outcomes_total", engine="p0", leg="prefill", outcome="connection"
    )
    # Health sweeps see the dead engine too; both record connection failures, nothing else.
    failures = _value(samples, "narwhal_engine_failures_total", engine="p0")
    assert failures >= 2
    assert failures == _value(
        samples, "narwhal_engine_failures_total", engine="p0", failure_class="connection"
    )
    assert _value(samples, "narwhal_engine_failures_total", engine="d0") == 0
    assert rr.router.fleet.get("p0").evidence.get(FailureClass.CONNECTION, 0) >= 1
    assert sims.decode.requests() == []


async def test_killed_decode_is_a_connection_failure(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    sims = _start_pair(sim_factory)
    rr = await _router(start_router, sims)
    sims.decode.kill()
    _assert_openai_error(await _complete(http, rr, True), 502)
    samples = await _metrics(http, rr)
    assert _value(samples, "narwhal_leg_outcomes_total", engine="d0", leg="decode") == 1
    assert _value(samples, "narwhal_leg_outcomes_total", engine="d0", outcome="connection") == 1
    assert _value(samples, "narwhal_engine_failures_total", engine="p0") == 0


async def test_stopped_decode_misses_the_first_token_deadline(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """SIGSTOP: the kernel still accepts the connection, but nothing ever answers."""
    sims = _start_pair(sim_factory)
    rr = await _router(start_router, sims)
    sims.decode.freeze()
    try:
        started = time.monotonic()
        reply = await _complete(http, rr, True)
        elapsed = time.monotonic() - started
    finally:
        sims.decode.thaw()
    _assert_openai_error(reply, 504)
    assert elapsed < FAST["first_token_timeout_s"] + 1.0  # not the 5 s request deadline
    samples = await _metrics(http, rr)
    assert (
        _value(samples, "narwhal_leg_outcomes_total", engine="d0", leg="decode", outcome="stream")
        == 1
    )


# ---------------------------------------------------------------- deadlines and capacity


async def test_request_deadline_mid_stream_ends_with_504_event_and_blames_no_engine(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The engine keeps producing, but the request's whole deadline runs out."""
    deadline_s = 1.0
    rr = await _router(start_router, sims, request_timeout_s=deadline_s, first_token_timeout_s=0.8)
    started = time.monotonic()
    reply = await _complete(http, rr, True, max_tokens=3000)  # about 6 s of tokens
    elapsed = time.monotonic() - started

    assert elapsed < deadline_s + 1.0  # the engine alone would stream for 6 s
    error = _assert_ends_with_error_event(reply)
    assert error["code"] == 504
    assert len(reply.events()) > 10  # tokens flowed until the deadline
    samples = await _metrics(http, rr)
    assert _value(samples, "narwhal_engine_failures_total") == 0
    assert rr.router.fleet.get("d0").evidence == {}
    await eventually(lambda: _idle(sims.decode), timeout_s=5, what="decode aborted")


async def _drain(http: aiohttp.ClientSession, rr: RunningRouter, engine: str) -> None:
    async with http.post(f"{rr.url}/admin/engines/{engine}/drain") as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_no_capacity_is_503_with_retry_after(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession, role: str, stream: bool
) -> None:
    rr = await _router(start_router, sims)
    await _drain(http, rr, "p0" if role == "prefill" else "d0")

    error = _assert_openai_error(await _complete(http, rr, stream), 503)
    assert f"no capacity: {role}" in error["message"]
    async with http.get(rr.url + "/ready") as resp:
        assert (resp.status, await resp.text()) == (503, f"no capacity: {role}")
    assert sims.decode.requests() == []
    assert _value(await _metrics(http, rr), "narwhal_engine_failures_total") == 0


async def test_no_decode_capacity_sends_no_prefill(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(start_router, sims)
    await _drain(http, rr, "d0")
    # The sims are shared: a counter, not the held handoffs (an earlier test's expire).
    prefills = 'narwhal_sim_requests_total{leg="prefill"}'
    before = sims.prefill.metric(prefills)
    _assert_openai_error(await _complete(http, rr, False), 503)
    assert sims.prefill.requests() == []
    assert sims.prefill.metric(prefills) == before
