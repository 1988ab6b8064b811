"""Failure evidence end to end, one failure class at a time, with real faults on real engines.

Spec section "Failure evidence": streaks per engine and class; at `recovery.eject_after` a
`connection` streak ejects, `timeout`/`overload` streaks run a health probe, and `stream`,
`inference_status` and `kv_handoff` streaks pause the engine (inference-verification hold)
and probe it with a real prefill/decode round trip. DESIGN §2 (probes).

Hold scenarios use a 2 s monitor interval and start right after a pass, so the hold is
observable (over HTTP) until the next pass schedules the probe.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]
NO_SWEEPS = {"monitor_interval_s": 30.0}  # one pass at start, then none during the test
HOLD_WINDOW = {"monitor_interval_s": 2.0}


def fleet(prefills: list[SimProcess], decodes: list[SimProcess]) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "url": s.url, "role": "prefill"} for i, s in enumerate(prefills)] + [
        {"id": f"d{i}", "url": s.url, "role": "decode"} for i, s in enumerate(decodes)
    ]


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def engine(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> dict[str, Any]:
    body = await get_json(http, rr.url + "/admin/engines")
    return next(e for e in body["engines"] if e["id"] == engine_id)


async def complete(
    http: aiohttp.ClientSession, rr: RunningRouter, *, stream: bool = False, max_tokens: int = 4
) -> tuple[int, bytes]:
    body = {"model": "demo-model", "prompt": "failure classes", "max_tokens": max_tokens,
            "stream": stream}  # fmt: skip
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def burst(
    http: aiohttp.ClientSession, rr: RunningRouter, n: int = 2, *, stream: bool = False
) -> list[int]:
    """`n` concurrent requests: least-in-flight placement spreads them over a role's engines
    whatever the rotation's phase."""
    results = await asyncio.gather(*(complete(http, rr, stream=stream) for _ in range(n)))
    return [status for status, _ in results]


async def metrics(http: aiohttp.ClientSession, rr: RunningRouter) -> str:
    async with http.get(rr.url + "/metrics") as resp:
        return await resp.text()


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def completions(sim: SimProcess) -> int:
    return len(sim.requests())


def client_requests(sim: SimProcess) -> int:
    """Requests that were not the router's probes."""
    return len(sim.requests()) - len(probe_requests(sim))


def probe_requests(sim: SimProcess) -> list[dict[str, Any]]:
    return [r for r in sim.requests() if r["headers"].get("x-request-id", "").startswith(
        "narwhal-probe-")]  # fmt: skip


async def right_after_a_pass(rr: RunningRouter) -> None:
    """Return just after a monitor pass finished: the next one is a whole interval away."""
    passes = rr.router.monitor.status.passes
    await eventually(
        lambda: rr.router.monitor.status.passes > passes, timeout_s=5, what="a monitor pass"
    )


async def ejected(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> Any:
    return (await engine(http, rr, engine_id))["ejection"]


async def workers_caught_up(http: aiohttp.ClientSession, rr: RunningRouter) -> None:
    """Every data-plane worker has applied the control process's latest fleet snapshot (with
    one process there is none to wait for)."""

    async def caught_up() -> bool:
        async with http.get(rr.url + "/admin/workers") as resp:
            doc = await resp.json()
        if doc["control"] is None:  # one process: it is the data plane
            return True
        version = doc["control"]["snapshot_version"]
        return all(w["snapshot_version"] >= version for w in doc["workers"])

    await eventually(caught_up, what="every worker on the latest fleet snapshot")


def hold_names(state: dict[str, Any]) -> list[str]:
    return list(state["holds"])


async def fail_until_held(
    http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str, *, stream: bool = False
) -> list[int]:
    """Send bursts until `engine_id` carries an inference-verification hold. Each burst starts
    right after a monitor pass: the pass after a hold is placed probes the engine, and a
    passing probe (the fault spent) releases it, so the hold must be seen, and judged, within
    the same interval. On a loaded run, two bursts and a look once spanned a pass: the hold
    came and went unseen, the fault was spent, and 24 streams later d1 was "never held"."""
    statuses: list[int] = []
    for _ in range(12):
        await right_after_a_pass(rr)
        statuses += await burst(http, rr, stream=stream)
        if "inference_verification" in hold_names(await engine(http, rr, engine_id)):
            return statuses
    state = await engine(http, rr, engine_id)
    raise AssertionError(f"{engine_id} was never held; statuses {statuses}; its state {state}")


async def assert_peers_serve_during_hold(
    http: aiohttp.ClientSession, rr: RunningRouter, held: SimProcess, engine_id: str,
    *, stream: bool = False,
) -> None:  # fmt: skip
    """While the hold lasts, new requests succeed and none reaches the held engine (its
    probe may: on a loaded host the monitor's next pass can come within the check)."""
    before = client_requests(held)
    state = await engine(http, rr, engine_id)
    assert state["eligible"] is False
    results = await asyncio.gather(*(complete(http, rr, stream=stream) for _ in range(4)))
    for status, raw in results:
        assert status == 200, raw
        if stream:
            assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    state = await engine(http, rr, engine_id)
    assert "inference_verification" in hold_names(state), "the hold ended too early to judge"
    assert client_requests(held) == before


# ------------------------------------------------------------------------------- connection
async def test_refused_connections_eject_after_the_streak_and_peers_keep_serving(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A killed prefill engine: every data-path connect is refused; no monitor sweeps."""
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    rr = await start_router(
        fleet([p0, p1], [d0]),
        controller=NO_SWEEPS,
        recovery={"eject_after": 2},
        serving={"policy": "bounded", "max_attempts": 2},
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    p1.kill()
    statuses = [status for _ in range(4) for status in await burst(http, rr)]
    assert statuses == [200] * 8, "the bounded policy retries a refused prefill on the peer"

    record = await ejected(http, rr, "p1")
    assert record is not None
    assert record["cause"] == "connection"
    assert record["evidence"]["connection"] == 2  # ejected at the streak, not later
    text = await metrics(http, rr)
    # Every refused connect is counted: the streak's two, and with workers any a worker made
    # before the ejection's snapshot reached it (on a loaded machine, one burst's worth).
    failures = metric(text, "narwhal_engine_failures_total", engine="p1",
                      failure_class="connection")  # fmt: skip
    assert failures >= 2
    assert metric(text, "narwhal_ejections_total", engine="p1", cause="connection") == 1
    # Once every process knows, nothing is sent to p1 any more: more requests, no failures.
    await workers_caught_up(http, rr)
    assert await burst(http, rr, 4) == [200] * 4
    text = await metrics(http, rr)
    assert metric(text, "narwhal_engine_failures_total", engine="p1",
                  failure_class="connection") == failures  # fmt: skip


@pytest.mark.slow
async def test_refusing_engine_is_ejected_by_health_sweeps_and_readmitted_after(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    rr = await start_router(
        fleet([p0, p1], [d0]), recovery={"eject_after": 2, "liveness_misses": 10}
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    p1.add_fault({"kind": "refuse_connections", "duration_s": 1.5})
    record = await eventually(lambda: ejected(http, rr, "p1"), timeout_s=5, what="p1 ejected")
    assert record["cause"] == "connection"
    assert record["evidence"]["connection"] == 2
    assert [(await complete(http, rr))[0] for _ in range(6)] == [200] * 6

    async def back() -> dict[str, Any] | None:
        state = await engine(http, rr, "p1")
        return state if state["ejected"] is False else None

    state = await eventually(back, timeout_s=10, what="p1 readmitted")
    assert set(state["evidence"].values()) == {0}
    assert state["eligible"] is True
    assert [s["ok"] for s in state["readmission"]] == [True] * len(state["readmission"])


# ------------------------------------------------------------------------------- overload
@pytest.mark.parametrize("status", [429, 408])
async def test_overload_streak_runs_a_health_probe_that_clears_it(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, status: int
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(fleet([p0], [d0]), controller=NO_SWEEPS, recovery={"eject_after": 3})
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    p0.add_fault({"kind": "completion_status", "status": status, "leg": "prefill", "count": 3})

    for n in (1, 2):
        code, raw = await complete(http, rr)
        assert code == 503, raw  # saturation: the client may retry later
        assert (await engine(http, rr, "p0"))["evidence"]["overload"] == n
    code, raw = await complete(http, rr)
    assert code == 503, raw

    async def probed() -> bool:
        text = await metrics(http, rr)
        return metric(text, "narwhal_probes_total", engine="p0", kind="suspect_health",
                      result="ok") == 1  # fmt: skip

    await eventually(probed, timeout_s=5, what="a suspect health probe")
    state = await engine(http, rr, "p0")
    assert state["evidence"]["overload"] == 0
    assert state["ejected"] is False
    assert state["holds"] == []
    assert (await complete(http, rr))[0] == 200


async def test_overload_streak_with_failing_health_is_confirmed_and_ejects(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    rr = await start_router(
        fleet([p0, p1], [d0]), controller=NO_SWEEPS, recovery={"eject_after": 2}
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    p1.add_fault({"kind": "completion_status", "status": 429, "leg": "prefill"})
    p1.add_fault({"kind": "health_status", "status": 503})
    statuses = [status for _ in range(3) for status in await burst(http, rr)]
    assert set(statuses) <= {200, 503}
    record = await eventually(lambda: ejected(http, rr, "p1"), timeout_s=5, what="p1 ejected")
    assert record["cause"] == "overload"
    assert [(await complete(http, rr))[0] for _ in range(4)] == [200] * 4


# ------------------------------------------------------------------------------- timeout
async def test_timeout_streak_confirmed_by_a_silent_health_probe_ejects(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0, d1 = sim_factory.start_many([PREFILL, DECODE, DECODE])
    d1.add_fault({"kind": "health_hang", "delay_s": 30})
    rr = await start_router(
        fleet([p0], [d0, d1]),
        recovery={"eject_after": 2, "liveness_misses": 20},
        engine={"health_timeout_s": 0.2},
    )
    record = await eventually(lambda: ejected(http, rr, "d1"), timeout_s=5, what="d1 ejected")
    assert record["cause"] == "timeout"
    text = await metrics(http, rr)
    assert metric(text, "narwhal_probes_total", engine="d1", kind="suspect_health",
                  result="silent") == 1  # fmt: skip
    assert [(await complete(http, rr))[0] for _ in range(4)] == [200] * 4


async def test_timeout_streak_cleared_by_a_successful_health_probe(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0, d1 = sim_factory.start_many([PREFILL, DECODE, DECODE])
    rr = await start_router(
        fleet([p0], [d0, d1]),
        recovery={"eject_after": 2, "liveness_misses": 20},
        engine={"health_timeout_s": 0.2},
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    d1.add_fault({"kind": "health_hang", "delay_s": 30, "count": 2})

    async def probed() -> bool:
        text = await metrics(http, rr)
        return metric(text, "narwhal_probes_total", engine="d1", kind="suspect_health",
                      result="ok") == 1  # fmt: skip

    await eventually(probed, timeout_s=5, what="a suspect health probe")
    state = await engine(http, rr, "d1")
    assert state["ejected"] is False
    assert state["evidence"]["timeout"] == 0
    assert state["liveness_misses"] == 0


# ------------------------------------------------------------------------- inference_status
@pytest.mark.slow
async def test_5xx_streak_holds_then_a_failed_probe_ejects(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0, d1 = sim_factory.start_many([PREFILL, DECODE, DECODE])
    rr = await start_router(fleet([p0], [d0, d1]), controller=HOLD_WINDOW,
                            recovery={"eject_after": 2})  # fmt: skip
    await right_after_a_pass(rr)
    d1.add_fault({"kind": "completion_status", "status": 500, "leg": "decode"})

    statuses = await fail_until_held(http, rr, "d1")
    assert statuses.count(502) == 2 and set(statuses) == {200, 502}, statuses
    state = await engine(http, rr, "d1")
    assert state["evidence"]["inference_status"] == 2
    assert state["ejected"] is False
    hold = next(h for h in state["hold_details"] if h["name"] == "inference_verification")
    assert "inference_status" in hold["reason"]
    await assert_peers_serve_during_hold(http, rr, d1, "d1")

    # The fault stays: the probe's decode leg (on p0's real handoff) fails; d1 is ejected.
    record = await eventually(lambda: ejected(http, rr, "d1"), timeout_s=5, what="d1 ejected")
    assert record["cause"] == "inference_status"
    probes = probe_requests(d1)
    assert probes and probes[-1]["leg"] == "decode"
    assert probes[-1]["body"]["kv_transfer_params"]["remote_engine_id"], "a real handoff"
    text = await metrics(http, rr)
    assert metric(text, "narwhal_probes_total", engine="d1", kind="inference",
                  result="failed") == 1  # fmt: skip


# ------------------------------------------------------------------------------- kv_handoff
@pytest.mark.slow
async def test_garbage_handoff_streak_holds_then_a_failed_probe_ejects(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    rr = await start_router(fleet([p0, p1], [d0]), controller=HOLD_WINDOW,
                            recovery={"eject_after": 2})  # fmt: skip
    await right_after_a_pass(rr)
    p1.add_fault({"kind": "handoff_garbage", "leg": "prefill"})

    statuses = await fail_until_held(http, rr, "p1")
    assert statuses.count(502) == 2 and set(statuses) == {200, 502}, statuses
    state = await engine(http, rr, "p1")
    assert state["evidence"]["kv_handoff"] == 2
    await assert_peers_serve_during_hold(http, rr, p1, "p1")

    record = await eventually(lambda: ejected(http, rr, "p1"), timeout_s=5, what="p1 ejected")
    assert record["cause"] == "kv_handoff"
    probes = probe_requests(p1)
    assert probes and probes[-1]["leg"] == "prefill"
    # Narwhal never forwarded an unreadable handoff: every decode leg carried a real one.
    for request in d0.requests():
        params = request["body"]["kv_transfer_params"]
        assert isinstance(params["remote_engine_id"], str), params
        assert isinstance(params["remote_port"], int), params


# ------------------------------------------------------------------------------- stream
@pytest.mark.slow
async def test_mid_stream_stall_streak_holds_then_a_passing_probe_clears(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0, d1 = sim_factory.start_many([PREFILL, DECODE, DECODE])
    rr = await start_router(
        fleet([p0], [d0, d1]),
        controller=HOLD_WINDOW,
        recovery={"eject_after": 2},
        serving={"stream_idle_timeout_s": 0.3},
    )
    await right_after_a_pass(rr)
    # Two stalls: the streak; then the fault is spent, i.e. removed while d1 is held.
    d1.add_fault({"kind": "stall_mid_stream", "after_tokens": 2, "delay_s": 5, "leg": "decode",
                  "count": 2})  # fmt: skip

    statuses = await fail_until_held(http, rr, "d1", stream=True)
    assert set(statuses) == {200}, "streams fail after their first byte: status 200"
    await assert_peers_serve_during_hold(http, rr, d1, "d1", stream=True)
    state = await engine(http, rr, "d1")
    assert state["evidence"]["stream"] == 2
    assert [f["fired"] for f in d1.faults()] == [2]
    d1.clear_faults()

    async def released() -> dict[str, Any] | None:
        state = await engine(http, rr, "d1")
        return None if state["holds"] else state

    state = await eventually(released, timeout_s=5, what="d1's hold released")
    assert state["ejected"] is False
    assert state["evidence"]["stream"] == 0
    assert state["eligible"] is True
    text = await metrics(http, rr)
    assert metric(text, "narwhal_probes_total", engine="d1", kind="inference",
                  result="ok") == 1  # fmt: skip
    # Back in placement: d1 takes (and completes) new streams again.
    before = completions(d1)
    assert await burst(http, rr, 4, stream=True) == [200] * 4
    assert completions(d1) > before


async def test_a_failed_stream_ends_with_an_error_event_and_no_done(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(fleet([p0], [d0]), recovery={"eject_after": 5},
                            serving={"stream_idle_timeout_s": 0.3})  # fmt: skip
    d0.add_fault({"kind": "stall_mid_stream", "after_tokens": 2, "delay_s": 5, "leg": "decode",
                  "count": 1})  # fmt: skip
    status, raw = await complete(http, rr, stream=True, max_tokens=8)
    assert status == 200
    assert b"[DONE]" not in raw
    last = raw.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ")
    error = json.loads(last[len(b"data: ") :])["error"]
    assert "stream" in error["message"]
    assert (await engine(http, rr, "d0"))["evidence"]["stream"] == 1


# ------------------------------------------------------------------------------ placement
async def test_sequential_requests_reach_every_engine(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Evidence needs traffic: with ties broken in rotation, one request after another must
    reach both engines of each role (else a sick engine is never seen, or never relieved)."""
    sims = sim_factory.start_many([PREFILL, PREFILL, DECODE, DECODE])
    rr = await start_router(fleet(sims[:2], sims[2:]))
    for _ in range(8):
        assert (await complete(http, rr))[0] == 200
    assert [completions(s) for s in sims] == [4, 4, 4, 4]
