"""What is never failure evidence, end to end: router overload, client disconnects, client
4xx, and requests the router itself refused (DESIGN §1-§2; spec "Failure evidence",
"Connection pools", "Clearing failure evidence").

`recovery.eject_after` is 1 wherever possible: a single wrongly recorded failure would then
hold or eject an engine at once, so "nothing happened" is a strong observation.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fleet import force_state
from tests.support.fs import remove_live_dir
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]


def fleet(prefills: list[SimProcess], decodes: list[SimProcess]) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "url": s.url, "role": "prefill"} for i, s in enumerate(prefills)] + [
        {"id": f"d{i}", "url": s.url, "role": "decode"} for i, s in enumerate(decodes)
    ]


async def all_engines(http: aiohttp.ClientSession, rr: RunningRouter) -> list[dict[str, Any]]:
    async with http.get(rr.url + "/admin/engines") as resp:
        assert resp.status == 200
        return list((await resp.json())["engines"])


async def assert_clean(http: aiohttp.ClientSession, rr: RunningRouter) -> None:
    """No evidence, no hold, no ejection, nothing in flight, on any engine."""
    for state in await all_engines(http, rr):
        assert set(state["evidence"].values()) == {0}, state
        assert state["holds"] == [], state
        assert state["ejected"] is False, state
        assert state["liveness_misses"] == 0, state
        assert state["in_flight"] == 0, state
    text = await get_metrics(http, rr)
    assert sum_metric(text, "narwhal_engine_failures_total") == 0


async def get_metrics(http: aiohttp.ClientSession, rr: RunningRouter) -> str:
    async with http.get(rr.url + "/metrics") as resp:
        return await resp.text()


def sum_metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def body(*, stream: bool = False, max_tokens: int = 4, prompt: str = "no evidence") -> bytes:
    return json.dumps({"model": "demo-model", "prompt": prompt, "max_tokens": max_tokens,
                       "stream": stream}).encode()  # fmt: skip


async def complete(
    http: aiohttp.ClientSession, rr: RunningRouter, **kwargs: Any
) -> tuple[int, bytes, dict[str, str]]:
    async with http.post(
        rr.url + "/v1/completions", data=body(**kwargs),
        headers={"Content-Type": "application/json"},
    ) as resp:  # fmt: skip
        return resp.status, await resp.read(), dict(resp.headers)


def running(sim: SimProcess) -> float:
    return sim.metric("vllm:num_requests_running")


# ------------------------------------------------------------------------------- overload
@pytest.mark.slow
async def test_router_overload_never_ejects_a_healthy_engine(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """40 concurrent slow streams against a data pool of 4: the surplus is refused with 503,
    health checks (control pool) keep succeeding, and no engine gets any evidence."""
    slow = ["--itl-ms", "30"]
    sims = sim_factory.start_many([PREFILL + slow, PREFILL + slow, DECODE + slow, DECODE + slow])
    rr = await start_router(
        fleet(sims[:2], sims[2:]),
        serving={"max_connections": 4},
        recovery={"eject_after": 1, "liveness_misses": 1},
        engine={"health_timeout_s": 1.0},
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    before = sum_metric(await get_metrics(http, rr), "narwhal_health_checks_total", result="ok")

    async def all_free() -> bool:
        text = await get_metrics(http, rr)
        return sum_metric(text, "narwhal_pool_connections_in_use", pool="data") == 0

    for _ in range(3):
        # A client reads `[DONE]` a moment before the router frees the request's data
        # connection: a round started meanwhile would find the pool full and serve nothing.
        await eventually(all_free, what="the last round's data connections freed")
        results = await asyncio.gather(
            *(complete(http, rr, stream=True, max_tokens=20) for _ in range(40))
        )
        served = [raw for status, raw, _ in results if status == 200]
        refused = [(raw, headers) for status, raw, headers in results if status == 503]
        assert len(served) + len(refused) == 40
        assert len(served) >= 4
        for raw in served:
            assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
        for raw, headers in refused:
            error = json.loads(raw)["error"]
            assert error["type"] == "service_unavailable" and "saturated" in error["message"]
            assert "Retry-After" in headers

    text = await get_metrics(http, rr)
    assert sum_metric(text, "narwhal_health_checks_total", result="ok") >= before + 4 * 3
    for result in ("error", "silent"):
        assert sum_metric(text, "narwhal_health_checks_total", result=result) == 0
    await assert_clean(http, rr)


# -------------------------------------------------------------------------- client disconnects
async def disconnect(rr: RunningRouter, payload: bytes, *, after_first_data: bool) -> None:
    """A real client on a real socket: send the request, then hang up."""
    host, port = rr.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(payload)}\r\n\r\n")  # fmt: skip
    writer.write(head.encode() + payload)
    await writer.drain()
    if after_first_data:
        await asyncio.wait_for(reader.readuntil(b"data: "), timeout=5)
    else:
        await asyncio.sleep(0.3)
    writer.close()
    await writer.wait_closed()


@pytest.mark.parametrize(
    ("where", "fault"),
    [
        ("mid_stream", None),
        ("before_the_first_token", {"kind": "stall_first_token", "delay_s": 10, "leg": "decode"}),
        ("during_the_prefill", {"kind": "stall_first_token", "delay_s": 10, "leg": "prefill"}),
    ],
)
async def test_a_client_disconnect_records_nothing_and_aborts_the_legs(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession,
    where: str, fault: dict[str, Any] | None,
) -> None:  # fmt: skip
    p0, d0 = sim_factory.start_many([[*PREFILL, "--itl-ms", "50"], [*DECODE, "--itl-ms", "50"]])
    rr = await start_router(
        fleet([p0], [d0]), recovery={"eject_after": 1}, serving={"first_token_timeout_s": 5}
    )
    target = p0 if where == "during_the_prefill" else d0
    if fault is not None:
        target.add_fault(fault)
    for _ in range(3):
        await disconnect(rr, body(stream=True, max_tokens=100),
                         after_first_data=where == "mid_stream")  # fmt: skip
        # The router aborted the upstream leg: the engine stopped working on it long before
        # it would have finished (5 s of tokens, or a 10 s stall).
        await eventually(lambda: running(target) == 0, timeout_s=2, what="upstream leg aborted")
        await eventually(
            lambda: all(rr.router.fleet.in_flight.of(e) == 0 for e in ("p0", "d0")),
            timeout_s=2, what="no request in flight",
        )  # fmt: skip
    await assert_clean(http, rr)
    text = await get_metrics(http, rr)
    assert sum_metric(text, "narwhal_requests_total", outcome="client_disconnect") == 3
    target.clear_faults()
    status, raw, _ = await complete(http, rr)
    assert status == 200, raw


# ------------------------------------------------------------------------------- client 4xx
async def test_an_engine_400_is_passed_through_and_is_not_evidence(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(fleet([p0], [d0]), recovery={"eject_after": 1})
    for _ in range(3):
        status, raw, _ = await complete(http, rr, prompt="")  # the engine rejects it: 400
        assert status == 400, raw
        assert b"The decoder prompt cannot be empty" in raw
    assert len(p0.requests()) == 3, "the engine itself answered"
    await assert_clean(http, rr)


@pytest.mark.single_process  # forces a state past the reducer, which no snapshot carries
async def test_an_engine_500_for_a_prompt_too_long_is_the_clients_400_and_not_evidence(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """When the router cannot judge the length itself (no limit learned yet, as an heir of
    an older router's handoff; or the counting engine down), the engine's vLLM-style 500 for
    an over-long prompt is still the client's: a 400, and no evidence against the engine."""
    p0, d0 = sim_factory.start_many([[*PREFILL, "--max-model-len", "64"], DECODE])
    rr = await start_router(
        fleet([p0], [d0]), recovery={"eject_after": 1}, controller={"monitor_interval_s": 30.0}
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    for engine in rr.router.fleet:  # no pass runs for 30 s: nothing learns it again
        force_state(rr.router.fleet, engine.id, max_model_len=None)
    for stream in (False, True, False):
        status, raw, _ = await complete(http, rr, stream=stream, prompt="word " * 100)
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert "longer than the maximum model length of 64" in error["message"], error
        assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert len(p0.requests()) == 3, "the engine itself judged each prompt"
    assert d0.requests() == []
    await assert_clean(http, rr)


# ----------------------------------------------------------------------------- refused by us
async def test_requests_refused_while_not_admitting_record_nothing(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        fleet([p0], [d0]), recovery={"eject_after": 1}, controller={"monitor_failure_limit": 1}
    )
    remove_live_dir(rr.router.handoff.path.parent)
    await eventually(lambda: not rr.router.admission.admitting, timeout_s=5, what="degraded")
    p0.clear_requests()
    d0.clear_requests()
    for stream in (False, True, False):
        status, raw, _ = await complete(http, rr, stream=stream)
        assert status == 503, raw
        assert "not admitting" in json.loads(raw)["error"]["message"]
    # A malformed body is the client's whatever the router's state: 400, never a 503 that
    # tells the client to send it again as is.
    async with http.post(rr.url + "/v1/completions", data=b'{"prompt": "hi') as resp:
        assert resp.status == 400, await resp.text()
    assert p0.requests() == [] and d0.requests() == []
    await assert_clean(http, rr)
    text = await get_metrics(http, rr)
    assert sum_metric(text, "narwhal_requests_total", outcome="not_admitted") == 3
    assert sum_metric(text, "narwhal_requests_total", outcome="bad_request") == 1


async def decode_gone(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> tuple[RunningRouter, SimProcess]:
    """A router whose only decode engine was killed and ejected: no decode capacity."""
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        fleet([p0], [d0]), recovery={"eject_after": 1, "liveness_misses": 1},
        engine={"health_timeout_s": 0.2},
    )  # fmt: skip
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    d0.kill()

    async def no_capacity() -> bool:
        async with http.get(rr.url + "/ready") as resp:
            return (resp.status, await resp.text()) == (503, "no capacity: decode")

    await eventually(no_capacity, timeout_s=5, what="no capacity: decode")
    p0.clear_requests()
    return rr, p0


def assert_no_capacity(status: int, raw: bytes) -> None:
    assert status == 503, raw
    assert json.loads(raw)["error"]["message"] == "no capacity: decode"


async def test_requests_refused_for_no_capacity_never_reach_an_engine(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr, p0 = await decode_gone(sim_factory, start_router, http)
    for _ in range(3):
        status, raw, _ = await complete(http, rr)
        assert_no_capacity(status, raw)
    assert p0.requests() == [], "a refused request must not cost a prefill"


async def test_requests_refused_for_no_capacity_record_no_evidence(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr, p0 = await decode_gone(sim_factory, start_router, http)
    p0.add_fault({"kind": "completion_status", "status": 500, "leg": "prefill"})
    for _ in range(3):
        status, raw, _ = await complete(http, rr)
        assert_no_capacity(status, raw)
    state = next(e for e in await all_engines(http, rr) if e["id"] == "p0")
    assert set(state["evidence"].values()) == {0}, state
    assert state["holds"] == [], state


async def test_requests_refused_for_no_capacity_record_no_evidence_against_a_healthy_prefill(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr, _ = await decode_gone(sim_factory, start_router, http)
    for _ in range(3):
        status, raw, _ = await complete(http, rr)
        assert_no_capacity(status, raw)
    state = next(e for e in await all_engines(http, rr) if e["id"] == "p0")
    assert set(state["evidence"].values()) == {0} and state["holds"] == [], state
    text = await get_metrics(http, rr)
    assert sum_metric(text, "narwhal_requests_total", outcome="no_capacity") == 3
