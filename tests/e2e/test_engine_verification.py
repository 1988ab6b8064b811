"""Engines are verified before they serve (DESIGN §10), end to end against narwhal-sim processes.

An engine is unverified until its first health 200 whose `/v1/models` names the configured
model; until then it gets no client request, and `/ready` answers 503
`starting: no verified <role> engine` while a role has no verified engine. The first sweep
runs at start (before the router reports itself listening and before the first pass), so a
healthy fleet is ready at once, not one monitor interval later. A
`--resume` that applied keeps the saved verification. The faults are real: the sims start with
`/health` answering 503 (`--fault`) or serving another model (`--model`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ("--role", "prefill", "--kv-role", "kv_producer")
DECODE = ("--role", "decode", "--kv-role", "kv_consumer")
UNHEALTHY = ("--fault", json.dumps({"kind": "health_status", "status": 503}))
BODY = {"model": "demo-model", "prompt": "verified before serving", "max_tokens": 4}


def engine(engine_id: str, sim: SimProcess, role: str) -> dict[str, Any]:
    return {"id": engine_id, "url": sim.url, "role": role}


async def ready(http: aiohttp.ClientSession, rr: RunningRouter) -> tuple[int, str]:
    async with http.get(rr.url + "/ready") as resp:
        return resp.status, await resp.text()


async def complete(http: aiohttp.ClientSession, rr: RunningRouter) -> tuple[int, Any]:
    async with http.post(rr.url + "/v1/completions", json=BODY) as resp:
        return resp.status, await resp.json()


def client_requests(sim: SimProcess) -> list[dict[str, Any]]:
    """Completion requests the sim got from clients (inference probes excluded)."""
    return [
        r
        for r in sim.requests()
        if not r["headers"].get("x-request-id", "").startswith("narwhal-probe-")
    ]


def admin_engine(rr: RunningRouter, engine_id: str) -> dict[str, Any]:
    return next(e for e in rr.router.engines_json() if e["id"] == engine_id)


async def test_a_healthy_fleet_is_ready_as_soon_as_the_router_reports_listening(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [engine("p0", p0, "prefill"), engine("d0", d0, "decode")],
        controller={"monitor_interval_s": 60},  # no regular pass in the test's time
    )
    assert await ready(http, rr) == (200, "ready")
    assert admin_engine(rr, "d0")["verified"] is True
    assert admin_engine(rr, "d0")["unverified_reason"] is None
    status, _ = await complete(http, rr)
    assert status == 200


async def test_an_engine_unhealthy_from_the_start_gets_no_client_request_until_healthy(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0, d1 = sim_factory.start_many([PREFILL, DECODE, (*DECODE, *UNHEALTHY)])
    rr = await start_router(
        [engine("p0", p0, "prefill"), engine("d0", d0, "decode"), engine("d1", d1, "decode")]
    )
    assert await ready(http, rr) == (200, "ready")  # d0 is verified: decode has capacity
    d1_state = admin_engine(rr, "d1")
    assert d1_state["verified"] is False and d1_state["eligible"] is False
    assert "HTTP 503" in d1_state["unverified_reason"]
    for _ in range(12):
        status, _ = await complete(http, rr)
        assert status == 200
    assert client_requests(d1) == []
    assert len(client_requests(d0)) == 12

    d1.clear_faults()  # finished loading: /health answers 200

    async def d1_serves() -> bool:
        await complete(http, rr)
        return bool(client_requests(d1))

    await eventually(d1_serves, timeout_s=20, interval_s=0.05, what="d1 gets client traffic")
    assert admin_engine(rr, "d1")["verified"] is True


async def test_only_decode_unhealthy_at_start_reports_starting(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, (*DECODE, *UNHEALTHY)])
    rr = await start_router([engine("p0", p0, "prefill"), engine("d0", d0, "decode")])
    assert await ready(http, rr) == (503, "starting: no verified decode engine")
    status, body = await complete(http, rr)
    assert status == 503
    assert body["error"]["type"] == "service_unavailable"
    assert body["error"]["message"] == "starting: no verified decode engine"
    assert client_requests(p0) == [] and client_requests(d0) == []  # no prefill spent

    metrics = await (await http.get(rr.url + "/metrics")).text()
    assert 'narwhal_engines_unverified{role="decode"} 1.0' in metrics
    assert 'narwhal_engines_unverified{role="prefill"} 0.0' in metrics

    d0.clear_faults()

    async def is_ready() -> bool:
        return await ready(http, rr) == (200, "ready")

    await eventually(is_ready, timeout_s=20, what="ready once d0 is seen healthy")
    status, _ = await complete(http, rr)
    assert status == 200


async def test_an_engine_serving_another_model_stays_unverified_and_says_why(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0, d1 = sim_factory.start_many([PREFILL, DECODE, (*DECODE, "--model", "other-model")])
    rr = await start_router(
        [engine("p0", p0, "prefill"), engine("d0", d0, "decode"), engine("d1", d1, "decode")]
    )
    passes = rr.router.monitor.status.passes
    await eventually(  # several passes: the verdict stands
        lambda: rr.router.monitor.status.passes >= passes + 3, what="three more passes"
    )
    async with http.get(rr.url + "/admin/engines") as resp:
        d1_state = next(e for e in (await resp.json())["engines"] if e["id"] == "d1")
    assert d1_state["verified"] is False and d1_state["eligible"] is False
    assert d1_state["unverified_reason"] == "serves ['other-model'], not 'demo-model'"
    for _ in range(6):
        assert (await complete(http, rr))[0] == 200
    assert client_requests(d1) == []


async def test_an_applied_resume_keeps_the_saved_verification(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    """A router restarted with --resume in front of an engine that now answers 503 keeps it
    verified, as the saved state says (it is then judged by evidence, as before the restart);
    the same restart without --resume waits to see it healthy."""
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    fleet = [engine("p0", p0, "prefill"), engine("d0", d0, "decode")]
    first = await start_router(fleet)
    handoff = Path(first.router.config.handoff.path)
    await eventually(lambda: first.router.handoff.writes > 0, what="a handoff written")
    await first.stop()
    saved = json.loads(await asyncio.to_thread(handoff.read_bytes))
    assert saved["engines"]["d0"]["verified"] is True

    d0.add_fault({"kind": "health_status", "status": 503})
    slow = {"monitor_interval_s": 60}  # only the start-up sweep runs in the test's time
    resumed = await start_router(fleet, controller=slow, router_kwargs={"resume": True})
    assert resumed.router.resume_verdict is not None and resumed.router.resume_verdict.ok
    assert admin_engine(resumed, "d0")["verified"] is True
    assert await ready(http, resumed) == (200, "ready")
    await resumed.stop()

    fresh = await start_router(fleet, controller=slow)
    assert admin_engine(fresh, "d0")["verified"] is False
    assert await ready(http, fresh) == (503, "starting: no verified decode engine")
