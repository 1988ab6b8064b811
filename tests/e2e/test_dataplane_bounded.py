"""The `bounded` serving policy: retry on another engine pair, within the request's deadline,
never after the first byte reached the client; each retry acquires fresh KV ownership.

Two prefill and two decode sims (and a unified sim for reference output) live for the module.
Placement breaks ties in rotation, so a test that needs the faulty engine to be tried first
repeats a (successful) request until the one-shot fault has fired.
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

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"
PROMPT = "retry me on another engine pair please"


@dataclass
class Sims:
    p0: SimProcess
    p1: SimProcess
    d0: SimProcess
    d1: SimProcess
    unified: SimProcess

    @property
    def prefills(self) -> tuple[SimProcess, SimProcess]:
        return self.p0, self.p1

    @property
    def decodes(self) -> tuple[SimProcess, SimProcess]:
        return self.d0, self.d1

    def all(self) -> tuple[SimProcess, ...]:
        return self.p0, self.p1, self.d0, self.d1, self.unified


@pytest.fixture(scope="module")
def shared() -> Iterator[Sims]:
    factory = SimFactory()
    p = ["--role", "prefill", "--kv-role", "kv_producer"]
    d = ["--role", "decode", "--kv-role", "kv_consumer"]
    try:
        yield Sims(*factory.start_many([p, p, d, d, ["--role", "both"]]))
    finally:
        factory.close()


def _idle(sim: SimProcess) -> Any:
    async def probe() -> bool:
        return await asyncio.to_thread(sim.metric, "vllm:num_requests_running") == 0

    return probe


@pytest.fixture
async def sims(shared: Sims) -> Sims:
    for sim in shared.all():
        sim.clear_faults()
        await eventually(_idle(sim), timeout_s=5, what="sim idle")
        sim.clear_requests()
    return shared


async def _router(start_router: StartRouter, sims: Sims, **serving: Any) -> RunningRouter:
    return await start_router(
        [{"id": "p0", "url": sims.p0.url, "role": "prefill"},
         {"id": "p1", "url": sims.p1.url, "role": "prefill"},
         {"id": "d0", "url": sims.d0.url, "role": "decode"},
         {"id": "d1", "url": sims.d1.url, "role": "decode"}],
        serving={"policy": "bounded", "max_attempts": 2, "first_token_timeout_s": 1.0,
                 "stream_idle_timeout_s": 0.5, "request_timeout_s": 5, **serving},
        recovery={"eject_after": 100, "liveness_misses": 100},
    )  # fmt: skip


async def _complete(
    http: aiohttp.ClientSession, url: str, stream: bool, **extra: Any
) -> tuple[int, bytes]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": stream, **extra}
    async with http.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


def _text(raw: bytes, stream: bool) -> str:
    if not stream:
        return str(json.loads(raw)["choices"][0]["text"])
    events = [e.strip() for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    return "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])


def _rid(entry: dict[str, Any]) -> str:
    return next(v for k, v in entry["headers"].items() if k.lower() == "x-request-id")


async def _metric(
    http: aiohttp.ClientSession, rr: RunningRouter, name: str, **labels: str
) -> float:
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _clear_requests(sims: Sims) -> None:
    for sim in sims.all():
        sim.clear_requests()


async def _until_fault_fires(
    http: aiohttp.ClientSession,
    rr: RunningRouter,
    sims: Sims,
    role: tuple[SimProcess, SimProcess],
    fault: dict[str, Any],
    stream: bool,
) -> tuple[SimProcess, SimProcess, bytes]:
    """Arm a one-shot `fault` on the engine of `role` that placement picks, and send requests
    (each must succeed) until it fired. Returns (faulty, other, the last response body)."""
    status, raw = await _complete(http, rr.url, stream)  # which engine does placement pick?
    assert status == 200, raw
    faulty = next(s for s in role if s.requests())
    other = next(s for s in role if s is not faulty)
    faulty.add_fault({**fault, "count": 1})
    for _ in range(4):
        _clear_requests(sims)
        status, raw = await _complete(http, rr.url, stream)
        assert status == 200, raw
        if faulty.faults()[0]["fired"]:
            return faulty, other, raw
    raise AssertionError("placement never tried the faulty engine")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("status", [500, 429])
async def test_failed_prefill_is_retried_on_the_other_prefill_with_a_new_request_id(
    sims: Sims,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    stream: bool,
    status: int,
) -> None:
    rr = await _router(start_router, sims)
    fault = {"kind": "completion_status", "status": status, "leg": "prefill"}
    faulty, other, raw = await _until_fault_fires(http, rr, sims, sims.prefills, fault, stream)

    _, ref = await _complete(http, sims.unified.url, stream)
    assert _text(raw, stream) == _text(ref, stream)
    (failed,), (retried,) = faulty.requests(), other.requests()
    decodes = [e for d in sims.decodes for e in d.requests()]
    assert len(decodes) == 1, "the failed prefill produced no decode leg"
    assert _rid(failed) != _rid(retried)
    assert _rid(decodes[0]) == _rid(retried)
    reason = "inference_status" if status == 500 else "saturated"
    assert await _metric(http, rr, "narwhal_retries_total", reason=reason) == 1
    cls = "inference_status" if status == 500 else "overload"
    engine = "p0" if faulty is sims.p0 else "p1"
    assert (
        await _metric(http, rr, "narwhal_engine_failures_total", engine=engine, failure_class=cls)
        == 1
    )
    assert await _metric(http, rr, "narwhal_engine_failures_total") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_failed_decode_is_retried_with_a_fresh_prefill_and_handoff(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession, stream: bool
) -> None:
    """A handoff is used at most once: the retry runs a new prefill under a new request id."""
    rr = await _router(start_router, sims)
    fault = {"kind": "completion_status", "status": 500, "leg": "decode"}
    faulty, other, raw = await _until_fault_fires(http, rr, sims, sims.decodes, fault, stream)

    _, ref = await _complete(http, sims.unified.url, stream)
    assert _text(raw, stream) == _text(ref, stream)
    prefills = [e for p in sims.prefills for e in p.requests()]
    (failed,), (served,) = faulty.requests(), other.requests()
    assert len(prefills) == 2
    assert _rid(prefills[0]) != _rid(prefills[1])
    assert {_rid(failed), _rid(served)} == {_rid(p) for p in prefills}
    first, second = failed["body"]["kv_transfer_params"], served["body"]["kv_transfer_params"]
    assert first["remote_request_id"] != second["remote_request_id"]
    assert await _metric(http, rr, "narwhal_retries_total", reason="inference_status") == 1


async def test_no_retry_after_the_first_byte(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A retry is a whole new attempt, never after the client had bytes; with migration off
    (`migration_limit: 0`) such a stream ends with the error event (tests/e2e/test_migration.py
    covers what migration does instead)."""
    rr = await _router(start_router, sims, max_attempts=3, migration_limit=0)
    for d in sims.decodes:
        d.add_fault({"kind": "stall_mid_stream", "leg": "decode", "after_tokens": 2})
    status, raw = await _complete(http, rr.url, True)

    assert status == 200
    events = [e.strip() for e in raw.split(b"\n\n") if e.strip()]
    assert b"data: [DONE]" not in events
    assert len(events) == 3  # two tokens, then the error event
    assert "error" in json.loads(events[-1][6:])
    assert sum(len(d.requests()) for d in sims.decodes) == 1
    assert sum(len(p.requests()) for p in sims.prefills) == 1
    assert await _metric(http, rr, "narwhal_retries_total") == 0


DEADLINE_S = 1.3  # a second full first-token wait would end at 2.0 s
MARGIN_S = 0.5


@pytest.mark.parametrize(
    ("leg", "stream"), [("prefill", False), ("prefill", True), ("decode", True)]
)
async def test_retries_never_exceed_the_request_deadline(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession, leg: str, stream: bool
) -> None:
    """Every engine of a role stalls: attempts stop at the request's original deadline."""
    rr = await _router(start_router, sims, max_attempts=5, request_timeout_s=DEADLINE_S)
    for sim in sims.prefills if leg == "prefill" else sims.decodes:
        sim.add_fault({"kind": "stall_first_token", "leg": leg})
    started = time.monotonic()
    status, raw = await _complete(http, rr.url, stream)
    elapsed = time.monotonic() - started

    assert elapsed < DEADLINE_S + MARGIN_S
    assert status == 504, raw
    assert "error" in json.loads(raw)
    stalled = sims.prefills if leg == "prefill" else sims.decodes
    assert [len(s.requests()) for s in stalled] == [1, 1], "retried on the other engine"
    assert await _metric(http, rr, "narwhal_retries_total") >= 1
