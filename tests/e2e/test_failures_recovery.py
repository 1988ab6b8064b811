"""Inconclusive probes, failure quarantine and last-engine protection, end to end.

Spec sections "Failure evidence" (inconclusive probe legs), "Failure quarantine" and
"Last-engine protection"; DESIGN §2 (probes, capacity). Real faults only: refused
connections, 5xx answers and garbage handoffs from narwhal-sim processes.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]


def fleet(prefills: list[SimProcess], decodes: list[SimProcess]) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "url": s.url, "role": "prefill"} for i, s in enumerate(prefills)] + [
        {"id": f"d{i}", "url": s.url, "role": "decode"} for i, s in enumerate(decodes)
    ]


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def get_text(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url) as resp:
        return resp.status, await resp.text()


async def engine(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> dict[str, Any]:
    body = await get_json(http, rr.url + "/admin/engines")
    return next(e for e in body["engines"] if e["id"] == engine_id)


async def complete(http: aiohttp.ClientSession, rr: RunningRouter) -> tuple[int, bytes]:
    body = {"model": "demo-model", "prompt": "recovery paths", "max_tokens": 4}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def burst(http: aiohttp.ClientSession, rr: RunningRouter, n: int = 2) -> list[int]:
    """Concurrent requests, so least-in-flight placement spreads them over a role's engines."""
    return [s for s, _ in await asyncio.gather(*(complete(http, rr) for _ in range(n)))]


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


async def probes(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str, kind: str,
                 result: str) -> float:  # fmt: skip
    text = (await get_text(http, rr.url + "/metrics"))[1]
    return metric(text, "narwhal_probes_total", engine=engine_id, kind=kind, result=result)


async def right_after_a_pass(rr: RunningRouter) -> None:
    passes = rr.router.monitor.status.passes
    await eventually(
        lambda: rr.router.monitor.status.passes > passes, timeout_s=5, what="a monitor pass"
    )


async def fail_until_held(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> None:
    for _ in range(12):
        await burst(http, rr)
        if "inference_verification" in (await engine(http, rr, engine_id))["holds"]:
            return
    raise AssertionError(f"{engine_id} was never held")


def hold(state: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((h for h in state["hold_details"] if h["name"] == name), None)


def assert_no_capacity(status: int, raw: bytes, role: str) -> None:
    assert status == 503, raw
    error = json.loads(raw)["error"]
    assert error["code"] == 503
    assert error["message"] == f"no capacity: {role}"


# ------------------------------------------------------------------------ inconclusive probe
@pytest.mark.slow
async def test_an_inconclusive_probe_keeps_the_hold_until_a_later_probe_concludes(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """d0 is held; the only prefill peer p0 goes down, so its probes cannot conclude."""
    p0, d0, d1 = sim_factory.start_many([PREFILL, DECODE, DECODE])
    rr = await start_router(
        fleet([p0], [d0, d1]),
        controller={"monitor_interval_s": 3.0},
        recovery={"eject_after": 2, "liveness_misses": 50},
    )
    # The hold and the peer's outage both land before the next pass can probe d0 (within
    # 3 s: a loaded host once took more than 1 s between the pass and the outage).
    await right_after_a_pass(rr)
    d0.add_fault({"kind": "completion_status", "status": 500, "leg": "decode"})
    await fail_until_held(http, rr, "d0")
    # At least eject_after; with data-plane workers a burst's two requests, placed at the same
    # moment in two processes, can both land on d0 before either failure is known.
    held_with = (await engine(http, rr, "d0"))["evidence"]["inference_status"]
    assert held_with >= 2
    p0.add_fault({"kind": "refuse_connections", "duration_s": 8.0})
    assert await probes(http, rr, "d0", "inference", "failed") == 0

    async def inconclusive(n: int) -> bool:
        return await probes(http, rr, "d0", "inference", "inconclusive") >= n

    await eventually(lambda: inconclusive(2), timeout_s=10, what="two inconclusive probes")
    state = await engine(http, rr, "d0")
    assert hold(state, "inference_verification") is not None
    assert state["ejected"] is False
    assert state["evidence"]["inference_status"] == held_with  # inconclusive: nothing added
    assert await probes(http, rr, "d0", "inference", "failed") == 0
    # The peer's failure is not held against d0, and p0's own health sweeps ejected it.
    assert (await engine(http, rr, "p0"))["ejection"]["cause"] == "connection"
    assert await get_text(http, rr.url + "/ready") == (503, "no capacity: prefill")

    # While no probe can conclude, the decode fault ends; once p0 is back, a probe concludes.
    d0.clear_faults()

    async def concluded() -> dict[str, Any] | None:
        state = await engine(http, rr, "d0")
        return None if state["holds"] else state

    state = await eventually(concluded, timeout_s=25, what="d0's hold released")
    assert state["ejected"] is False
    assert state["evidence"]["inference_status"] == 0
    assert await probes(http, rr, "d0", "inference", "ok") == 1
    assert (await engine(http, rr, "p0"))["ejected"] is False
    assert await get_text(http, rr.url + "/ready") == (200, "ready")
    assert await burst(http, rr, 4) == [200] * 4


@pytest.mark.slow
async def test_a_peer_failing_the_probe_is_inconclusive_and_peers_keep_serving(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """p1 is held for garbage handoffs; its probe's decode leg fails on the peer d0 (not p1's
    fault): inconclusive, the hold stays while p0 and d0 serve, and a later probe concludes."""
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    rr = await start_router(
        fleet([p0, p1], [d0]),
        controller={"monitor_interval_s": 1.0},
        recovery={"eject_after": 2},
    )
    await right_after_a_pass(rr)
    passed_before = 0.0
    for _ in range(3):
        # Read before the hold: the probe may pass (the fault on d0 not yet in place) while
        # the test reads p1's state, and a count read after it would hide it.
        passed_before = await probes(http, rr, "p1", "inference", "ok")
        failed_before = await probes(http, rr, "p1", "inference", "failed")
        p1.add_fault({"kind": "handoff_garbage", "leg": "prefill", "count": 2})
        await fail_until_held(http, rr, "p1")
        # 2 in one process; with data-plane workers a burst's request placed on p1 at the same
        # moment as the failing ones (before the hold reached its worker) may have cleared it.
        held_with = (await engine(http, rr, "p1"))["evidence"]["kv_handoff"]
        d0.clear_requests()
        # The next request d0 sees is the probe's decode leg: it fails there.
        d0.add_fault({"kind": "completion_status", "status": 500, "leg": "decode", "count": 1})

        async def settled(passed_before: float = passed_before,
                          failed_before: float = failed_before) -> str | None:  # fmt: skip
            if await probes(http, rr, "p1", "inference", "inconclusive") == 1:
                return "inconclusive"
            if await probes(http, rr, "p1", "inference", "ok") > passed_before:
                return "passed"
            if await probes(http, rr, "p1", "inference", "failed") > failed_before:
                raise AssertionError(f"p1's probe failed: {await engine(http, rr, 'p1')}")
            return None

        # The pass after the hold probes p1 at once; on a loaded machine it can do so before
        # the fault is in place, and then passes: a race of the test's, so it starts over.
        if await eventually(settled, timeout_s=10, what="p1's probe") == "inconclusive":
            break
        d0.clear_faults()
    else:
        raise AssertionError("p1 was probed before d0's fault was in place three times")
    probed = [
        r for r in d0.requests()
        if r["headers"].get("x-request-id", "").startswith("narwhal-probe-")
    ]  # fmt: skip
    assert [r["leg"] for r in probed] == ["decode"], "the probe's decode leg ran on d0"
    state = await engine(http, rr, "p1")
    assert hold(state, "inference_verification") is not None
    assert state["ejected"] is False and state["eligible"] is False
    assert state["evidence"]["kv_handoff"] == held_with  # inconclusive: nothing added
    # The peer's failure inside a probe is not evidence against the peer.
    assert set((await engine(http, rr, "d0"))["evidence"].values()) == {0}

    # Admission keeps sending new work to the eligible peers meanwhile.
    p1.clear_requests()
    assert await burst(http, rr, 4) == [200] * 4
    assert p1.requests() == []

    async def concluded() -> dict[str, Any] | None:
        state = await engine(http, rr, "p1")
        return None if state["holds"] else state

    state = await eventually(concluded, timeout_s=5, what="a later probe concludes")
    assert state["ejected"] is False
    assert state["evidence"]["kv_handoff"] == 0
    assert await probes(http, rr, "p1", "inference", "ok") == passed_before + 1


# ------------------------------------------------------------------------------ quarantine
@pytest.mark.slow
async def test_quarantine_blocks_readmission_until_its_deadline(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """d1 refuses connections for 5 s; quarantine 3 s: no readmission attempt before the
    deadline (health keeps failing, so nothing clears it early), attempts after it, and the
    engine returns once it answers again. (With 1 s a loaded host's first sample came after
    the deadline.)"""
    p0, d0, d1 = sim_factory.start_many([PREFILL, DECODE, DECODE])
    rr = await start_router(
        fleet([p0], [d0, d1]),
        recovery={"eject_after": 2, "liveness_misses": 50, "failure_quarantine_s": 3.0},
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    d1.add_fault({"kind": "refuse_connections", "duration_s": 5.0})

    async def quarantined() -> dict[str, Any] | None:
        state = await engine(http, rr, "d1")
        return state if hold(state, "failure_quarantine") else None

    state = await eventually(quarantined, timeout_s=5, what="d1 ejected and quarantined")
    assert state["ejection"]["cause"] == "connection"
    q = hold(state, "failure_quarantine")
    assert q is not None and q["deadline"] is not None
    assert q["deadline"] - q["since"] == pytest.approx(3.0, abs=0.01)
    assert q["deadline"] == pytest.approx(state["ejection"]["at"] + 3.0, abs=0.05)
    assert "connection" in q["reason"]

    # Sample /admin/engines until readmission: (wall time, quarantine listed, attempts made).
    samples: list[tuple[float, bool, int]] = []

    async def readmitted() -> bool:
        state = await engine(http, rr, "d1")
        samples.append(
            (time.time(), hold(state, "failure_quarantine") is not None, len(state["readmission"]))
        )
        return state["ejected"] is False

    await eventually(readmitted, timeout_s=15, what="d1 readmitted")
    before = [s for s in samples if s[0] < q["deadline"] - 0.02]
    after = [s for s in samples if s[0] > q["deadline"] + 0.3]
    assert before and after
    assert all(listed and attempts == 0 for _, listed, attempts in before), before
    assert not any(listed for _, listed, _ in after), "the hold expires at its deadline"
    assert any(attempts > 0 for _, _, attempts in after[:-1]), "failed attempts after the deadline"
    state = await engine(http, rr, "d1")
    assert set(state["evidence"].values()) == {0}
    assert state["holds"] == []
    assert [s["ok"] for s in state["readmission"]] == [True] * len(state["readmission"])


@pytest.mark.slow
async def test_health_200_clears_quarantine_early_and_readmission_returns_the_engine(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """p1 is ejected by a failed inference probe (garbage handoffs) under a 30 s quarantine;
    its /health answers 200, which clears the quarantine long before the deadline, and the
    readmission pipeline returns it with its evidence cleared."""
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    rr = await start_router(
        fleet([p0, p1], [d0]),
        # The next pass clears the quarantine (health 200): 2 s to see it first (a loaded
        # host once took more than the 0.5 s this had).
        controller={"monitor_interval_s": 2.0},
        recovery={"eject_after": 2, "failure_quarantine_s": 30},
    )
    await right_after_a_pass(rr)
    p1.add_fault({"kind": "handoff_garbage", "leg": "prefill"})
    await fail_until_held(http, rr, "p1")

    async def ejected() -> dict[str, Any] | None:
        state = await engine(http, rr, "p1")
        return state if state["ejected"] else None

    state = await eventually(ejected, timeout_s=10, what="p1 ejected")
    p1.clear_faults()
    assert state["ejection"]["cause"] == "kv_handoff"
    assert state["ejection"]["evidence"]["kv_handoff"] == 2
    q = hold(state, "failure_quarantine")
    assert q is not None
    assert q["deadline"] - q["since"] == pytest.approx(30, abs=0.01)
    assert state["evidence"]["kv_handoff"] == 2  # health 200 does not clear kv_handoff

    async def back() -> dict[str, Any] | None:
        state = await engine(http, rr, "p1")
        return state if state["ejected"] is False else None

    state = await eventually(back, timeout_s=15, what="p1 readmitted")
    assert time.time() < q["deadline"] - 20, "readmitted long before the quarantine deadline"
    assert state["holds"] == []
    assert set(state["evidence"].values()) == {0}, "readmission clears the evidence"
    steps = state["readmission"]
    assert steps[0]["step"] == "health" and steps[-1]["step"] == "final_health", steps
    assert all(s["ok"] for s in steps), steps
    assert await burst(http, rr, 4) == [200] * 4


# --------------------------------------------------------------------- last-engine protection
@pytest.mark.slow
async def test_the_only_decode_engine_can_be_ejected_and_comes_back_after_the_fault(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(fleet([p0], [d0]), recovery={"eject_after": 2, "liveness_misses": 50})
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    assert await get_text(http, rr.url + "/ready") == (200, "ready")
    d0.add_fault({"kind": "refuse_connections", "duration_s": 1.5})

    async def no_capacity() -> bool:
        return await get_text(http, rr.url + "/ready") == (503, "no capacity: decode")

    await eventually(no_capacity, timeout_s=5, what="/ready 503 no capacity: decode")
    assert (await engine(http, rr, "d0"))["ejection"]["cause"] == "connection"
    status, raw = await complete(http, rr)
    assert_no_capacity(status, raw, "decode")

    # Recovery keeps trying while there is no capacity; the engine returns after the fault.
    passes = rr.router.monitor.status.passes
    await eventually(no_capacity, timeout_s=1)
    await eventually(lambda: ready_again(http, rr), timeout_s=10, what="/ready 200 again")
    assert rr.router.monitor.status.passes > passes
    assert await probes(http, rr, "d0", "readmission:health", "failed") >= 1
    assert await probes(http, rr, "d0", "readmission:final_health", "ok") == 1
    assert await burst(http, rr, 3) == [200] * 3


async def ready_again(http: aiohttp.ClientSession, rr: RunningRouter) -> bool:
    return await get_text(http, rr.url + "/ready") == (200, "ready")


@pytest.mark.slow
async def test_a_confirmed_failure_of_the_only_decode_engine_keeps_it_out_while_it_fails(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        fleet([p0], [d0]),
        controller={"monitor_interval_s": 0.2},
        recovery={"eject_after": 2},
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    d0.add_fault({"kind": "completion_status", "status": 500, "leg": "decode"})
    statuses = [(await complete(http, rr))[0] for _ in range(2)]
    assert statuses == [502, 502]

    async def confirmed() -> Any:
        return (await engine(http, rr, "d0"))["ejection"]

    record = await eventually(confirmed, timeout_s=5, what="d0 ejected by its probe")
    assert record["cause"] == "inference_status"
    status, raw = await complete(http, rr)
    assert_no_capacity(status, raw, "decode")

    # The fault persists: over the next passes d0 stays out and /ready stays 503.
    passes = rr.router.monitor.status.passes
    while rr.router.monitor.status.passes < passes + 6:
        assert await get_text(http, rr.url + "/ready") == (503, "no capacity: decode")
        await asyncio.sleep(0.02)

    d0.clear_faults()
    await eventually(lambda: ready_again(http, rr), timeout_s=10, what="/ready 200 again")
    assert (await complete(http, rr))[0] == 200


# A slow prefill engine drifts (DESIGN §3 controller stage): 20x the prefill time of its
# peers, judged over closed 0.5 s intervals of real traffic.
DRIFT = {"interval_s": 0.5, "drift_min_samples": 5, "drift_intervals": 2, "drift_factor": 3,
         "drift_hold_s": 30, "drift_mode": "enforce"}  # fmt: skip
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


async def load(http: aiohttp.ClientSession, rr: RunningRouter, worker: int) -> None:
    """Back-to-back 50-token prompts (one sim token per word) until cancelled."""
    n = 0
    while True:
        n += 1
        words = [WORDS[(worker + n + i) % len(WORDS)] for i in range(48)]
        prompt = " ".join([f"w{worker}", f"n{n}", *words])
        body = {"model": "demo-model", "prompt": prompt, "max_tokens": 2}
        async with http.post(rr.url + "/v1/completions", json=body) as resp:
            await resp.read()


@pytest.mark.slow
async def test_a_drift_hold_preserves_the_last_eligible_engine_a_failure_removes_it(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, p2, d0 = sim_factory.start_many(
        [PREFILL, PREFILL, [*PREFILL, "--ttft-per-token-ms", "1.0"], DECODE]
    )
    rr = await start_router(
        fleet([p0, p1, p2], [d0]),
        controller=DRIFT,
        recovery={"eject_after": 1, "liveness_misses": 1},
        engine={"health_timeout_s": 0.3},
    )
    workers = [asyncio.create_task(load(http, rr, i)) for i in range(12)]
    try:
        held = await eventually(
            lambda: _held(http, rr, "p2", "performance_drift"), timeout_s=20, what="p2 drift hold"
        )
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    assert held["eligible"] is False, "with eligible peers the drift hold takes p2 out"

    # Its peers fail for real; p2, now the last prefill engine, serves despite its hold.
    p0.kill()
    p1.kill()
    for peer in ("p0", "p1"):
        await eventually(lambda peer=peer: _ejected(http, rr, peer), timeout_s=5, what=peer)
    state = await engine(http, rr, "p2")
    assert hold(state, "performance_drift") is not None
    assert state["eligible"] is True
    assert await get_text(http, rr.url + "/ready") == (200, "ready")
    p2.clear_requests()
    assert [(await complete(http, rr))[0] for _ in range(3)] == [200] * 3
    assert len(p2.requests()) == 3

    # A confirmed failure removes even the last engine.
    p2.kill()
    await eventually(lambda: _ejected(http, rr, "p2"), timeout_s=5, what="p2 ejected")
    assert await get_text(http, rr.url + "/ready") == (503, "no capacity: prefill")
    status, raw = await complete(http, rr)
    assert_no_capacity(status, raw, "prefill")


async def _held(
    http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str, name: str
) -> dict[str, Any] | None:
    state = await engine(http, rr, engine_id)
    return state if hold(state, name) else None


async def _ejected(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> Any:
    return (await engine(http, rr, engine_id))["ejection"]
