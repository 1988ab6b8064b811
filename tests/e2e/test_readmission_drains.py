"""Operator drains and automatic readmission end to end.

Spec chapter "Failure, readmission, and state", section "Readmission and drains": operator
drains survive successful health responses, router resume and standby takeover; successful
readmission clears an operator drain. DESIGN §2: ejected engines are retried automatically
with backoff; `operator_drain` is cleared only by a successful readmission that the operator
asks for. DESIGN §3: the `drains` monitor stage settles drains (`drain_settled` in
`/admin/engines` once nothing is in flight).

Real sims, a real router on loopback, real faults (closed listening sockets).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.test_readmission_support import (
    DECODE,
    MODEL,
    PREFILL,
    SLOW_PREFILL,
    TOKEN,
    Admin,
    burst_share,
    complete,
    engine,
    hold_names,
    in_service,
    metric,
    prefill_legs,
    send,
    two_prefill,
)
from tests.support.poll import eventually
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory, SimProcess


async def assert_traffic_avoids(
    http: aiohttp.ClientSession, url: str, drained: SimProcess, peer: SimProcess, n: int = 6
) -> None:
    assert await burst_share(http, url, [drained, peer], n) == [0, n]


# --------------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_drain_moves_new_traffic_to_the_peer_and_health_never_clears_it(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    rr = await start_router(two_prefill(p0, p1, d0), admin={"token": TOKEN})
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    assert min(await burst_share(http, rr.url, [p0, p1])) > 0  # both serve before the drain

    await admin.drain("p0")
    e = await admin.engine("p0")
    assert e["eligible"] is False and e["ejected"] is False
    assert [(h["name"], h["deadline"]) for h in e["hold_details"]] == [("operator_drain", None)]
    await assert_traffic_avoids(http, rr.url, p0, p1)
    async with http.get(rr.url + "/ready") as resp:
        assert resp.status == 200  # p1 still carries prefill

    # Many passes of successful health responses later, the drain is still there.
    text = await admin.metrics()
    before = metric(text, "narwhal_health_checks_total", engine="p0", result="ok")
    await admin.wait_passes(25)
    after = metric(await admin.metrics(), "narwhal_health_checks_total", engine="p0", result="ok")
    assert after - before >= 20
    e = await admin.engine("p0")
    assert hold_names(e) == ["operator_drain"] and e["eligible"] is False
    assert e["drain_settled"] is True and e["liveness_misses"] == 0
    await assert_traffic_avoids(http, rr.url, p0, p1, n=4)

    # A drain is idempotent: asking again keeps one hold, with its original start.
    since = e["hold_details"][0]["since"]
    await admin.drain("p0")
    assert [h["since"] for h in (await admin.engine("p0"))["hold_details"]] == [since]

    # Successful operator readmission clears it; p0 takes traffic again.
    status, body = await admin.readmit("p0")
    assert status == 200 and body["readmitted"] is True, body
    e = await admin.engine("p0")
    assert e["holds"] == [] and e["eligible"] is True
    assert e["readmission"] == body["steps"]
    await admin.wait_engine("p0", lambda e: e["drain_settled"] is False, "drain no longer settled")
    assert min(await burst_share(http, rr.url, [p0, p1])) > 0


@pytest.mark.slow
async def test_draining_the_last_engine_of_a_role_leaves_no_capacity(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A drain is a hard hold: no last-engine protection (only soft holds have it)."""
    p0, d0 = sim_factory.start_many([list(PREFILL), list(DECODE)])
    rr = await start_router(
        [engine("p0", p0.url, "prefill"), engine("d0", d0.url, "decode")], admin={"token": TOKEN}
    )
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    await admin.drain("d0")
    async with http.get(rr.url + "/ready") as resp:
        assert (resp.status, await resp.text()) == (503, "no capacity: decode")
    status, raw = await complete(http, rr.url)
    assert status == 503, raw
    status, body = await admin.readmit("d0")
    assert status == 200, body
    await admin.wait_ready(timeout_s=5)
    assert (await complete(http, rr.url))[0] == 200


@pytest.mark.slow
async def test_stream_in_flight_at_the_drain_finishes_and_then_the_drain_settles(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0, d1 = sim_factory.start_many(
        [list(PREFILL), [*DECODE, "--itl-ms", "40"], [*DECODE, "--itl-ms", "40"]]
    )
    rr = await start_router(
        [engine("p0", p0.url, "prefill"), engine("d0", d0.url, "decode"),
         engine("d1", d1.url, "decode")],
        admin={"token": TOKEN},
    )  # fmt: skip
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    body = {"model": MODEL, "prompt": "a long answer is streaming", "max_tokens": 40,
            "stream": True}  # fmt: skip
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        busy = [e for e in await admin.engines() if e["role"] == "decode" and e["in_flight"]]
        assert len(busy) == 1, busy
        target = busy[0]["id"]
        await admin.drain(target)
        e = await admin.engine(target)
        assert e["in_flight"] == 1 and e["drain_settled"] is False
        assert e["drain_settled_at"] is None
        await admin.wait_passes(2)
        e = await admin.engine(target)
        assert e["drain_settled"] is False and e["drain_settled_at"] is None  # still in flight
        rest = await resp.read()
        stream_ended = time.time()
    stream = first + rest
    assert stream.endswith(b"data: [DONE]\n\n"), stream[-200:]
    assert b'"error"' not in stream
    assert stream.count(b"data: ") == 41  # 40 tokens and [DONE]
    e = await admin.wait_engine(target, lambda e: e["drain_settled"], "drain settled")
    assert e["in_flight"] == 0 and hold_names(e) == ["operator_drain"]
    # When in-flight reached zero: after the stream ended, within a few monitor passes.
    assert stream_ended - 1.0 <= e["drain_settled_at"] <= time.time(), (stream_ended, e)
    # New work goes to the other decode engine.
    other = d1 if target == "d0" else d0
    drained = d0 if target == "d0" else d1
    await asyncio.to_thread(other.clear_requests)
    await asyncio.to_thread(drained.clear_requests)
    await send(http, rr.url, 3)
    assert len(await asyncio.to_thread(drained.requests)) == 0
    assert len(await asyncio.to_thread(other.requests)) == 3


# --------------------------------------------------------------------------------------------
async def wait_handoff_drain(admin: Admin, engine_id: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        status, body = await admin.get("/admin/handoff")
        doc = body.get("document") if status == 200 else None
        if doc is None:
            return None
        holds = [h["name"] for h in doc["engines"][engine_id]["holds"]]
        return doc if "operator_drain" in holds else None

    doc: dict[str, Any] = await eventually(probe, timeout_s=10, what="the drain in the handoff")
    return doc


@pytest.mark.slow
async def test_drain_survives_router_resume(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    engines = two_prefill(p0, p1, d0)
    first = await start_router(engines, admin={"token": TOKEN})
    admin = Admin(http, first.url)
    await admin.wait_ready()
    await admin.drain("p0")
    await wait_handoff_drain(admin, "p0")
    await first.stop()

    resumed = await start_router(engines, admin={"token": TOKEN}, router_kwargs={"resume": True})
    assert resumed.router.resume_verdict is not None and resumed.router.resume_verdict.ok
    admin = Admin(http, resumed.url)
    e = await admin.engine("p0")
    assert hold_names(e) == ["operator_drain"] and e["eligible"] is False
    await admin.wait_passes(15)  # health 200s on the resumed router do not clear it either
    assert hold_names(await admin.engine("p0")) == ["operator_drain"]
    await assert_traffic_avoids(http, resumed.url, p0, p1)
    status, body = await admin.readmit("p0")
    assert status == 200 and (await admin.engine("p0"))["holds"] == [], body


@pytest.mark.slow
async def test_drain_survives_standby_takeover(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:  # fmt: skip
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    engines = two_prefill(p0, p1, d0)
    lease = {"backend": "file", "path": str(tmp_path / "state" / "lease.json"), "ttl_s": 2.0,
             "renew_interval_s": 0.5}  # fmt: skip
    active = await start_router(engines, router_id="router-a", lease=lease, admin={"token": TOKEN})
    a = Admin(http, active.url)
    await a.wait_ready()
    standby = await start_router(
        engines, router_id="router-b", lease=lease, admin={"token": TOKEN},
        standby={"active_url": active.url, "takeover_threshold": 3},
        router_kwargs={"standby": True},
    )  # fmt: skip
    b = Admin(http, standby.url)
    await a.drain("p0")
    await wait_handoff_drain(a, "p0")
    # The standby follows the active's handoff: the drain is already there.
    await b.wait_engine("p0", lambda e: "operator_drain" in hold_names(e), "standby follows")
    async with http.get(standby.url + "/ready") as resp:
        assert resp.status == 503 and (await resp.text()).startswith("standby")

    await active.stop()  # the active goes away; the standby takes the lease
    await b.wait_ready(timeout_s=15)
    status, lease_view = await b.get("/admin/lease")
    assert status == 200 and lease_view["role"] == "active", lease_view
    e = await b.engine("p0")
    assert hold_names(e) == ["operator_drain"] and e["eligible"] is False
    await b.wait_passes(15)
    assert hold_names(await b.engine("p0")) == ["operator_drain"]
    await assert_traffic_avoids(http, standby.url, p0, p1)
    status, body = await b.readmit("p0")
    assert status == 200 and (await b.engine("p0"))["holds"] == [], body


# --------------------------------------------------------------------------------------------
async def readmission_attempts(admin: Admin, engine_id: str) -> float:
    """Readmission attempts so far: every attempt starts with the health step."""
    text = await admin.metrics()
    return sum(
        metric(text, "narwhal_probes_total", engine=engine_id, kind="readmission:health", result=r)
        for r in ("ok", "failed")
    )


@pytest.mark.slow
async def test_ejected_engine_is_retried_with_backoff_and_returns_with_evidence_cleared(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    rr = await start_router(
        two_prefill(p0, p1, d0), admin={"token": TOKEN}, router_kwargs={"rng": random.Random(7)}
    )
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    outage_s = 4.0
    await asyncio.to_thread(p0.add_fault, {"kind": "refuse_connections", "duration_s": outage_s})
    outage_ends = time.monotonic() + outage_s
    e = await admin.wait_engine("p0", lambda e: e["ejected"] is True, "ejected", 5)
    assert e["ejection"]["cause"] in ("connection", "liveness"), e["ejection"]
    assert e["eligible"] is False
    passes_at_ejection = (await admin.monitor())["passes"]

    # Watch the attempts (every 20 ms) until p0 is back.
    attempts: list[float] = []
    seen = await readmission_attempts(admin, "p0")
    back: dict[str, Any] | None = None
    deadline = time.monotonic() + 20
    while back is None and time.monotonic() < deadline:
        count = await readmission_attempts(admin, "p0")
        if count > seen:
            attempts.extend([time.monotonic()] * int(count - seen))
            seen = count
        current = await admin.engine("p0")
        if current["ejected"] is False:
            back = current
        elif time.monotonic() < outage_ends - 0.2:
            steps = current["readmission"]
            if steps:
                assert steps[-1]["step"] == "health" and steps[-1]["ok"] is False, steps
        await asyncio.sleep(0.02)
    assert back is not None, "p0 was not readmitted after the outage"
    assert time.monotonic() >= outage_ends - 0.1  # not before the engine answered again
    passes = (await admin.monitor())["passes"] - passes_at_ejection

    # Backoff: far fewer attempts than passes, with growing gaps (base = monitor interval
    # 0.1 s, doubling, jittered into [d/2, d], capped at 30 x interval).
    assert 3 <= len(attempts) <= 9, attempts
    assert passes >= 3 * len(attempts), (passes, len(attempts))
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[-1] >= 0.7, gaps
    # 2x only across two doublings: jittered into [d/2, d], one doubling can show as 1x-4x
    # (the loaded run of 2026-12-07 10:32 saw three attempts: gaps 1.36 and 2.05 s).
    if len(gaps) >= 3:
        assert gaps[0] < gaps[-1] / 2, gaps
    for earlier, later in itertools.pairwise(gaps):
        assert later >= earlier - 0.3, gaps  # never shrinking (pass timing adds some noise)

    # Back in service with the evidence cleared.
    assert back["holds"] == [] and back["eligible"] is True and back["liveness_misses"] == 0
    assert set(back["evidence"].values()) == {0}, back["evidence"]
    assert [s["ok"] for s in back["readmission"]] == [True] * len(back["readmission"])
    assert min(await burst_share(http, rr.url, [p0, p1])) > 0


@pytest.mark.slow
async def test_automatic_readmission_of_an_ejected_engine_keeps_its_operator_drain(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([list(PREFILL), list(PREFILL), list(DECODE)])
    rr = await start_router(two_prefill(p0, p1, d0), admin={"token": TOKEN})
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    await admin.drain("p0")
    await asyncio.to_thread(p0.add_fault, {"kind": "refuse_connections", "duration_s": 1.0})
    await admin.wait_engine("p0", lambda e: e["ejected"] is True, "ejected", 5)
    e = await admin.wait_engine("p0", lambda e: e["ejected"] is False, "ejection cleared", 15)
    assert hold_names(e) == ["operator_drain"], e["holds"]
    assert e["eligible"] is False
    assert not in_service(e)


@pytest.mark.slow
async def test_readmitted_engine_gets_its_share_of_sequential_traffic(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """DESIGN §1: least in-flight first, ties broken in rotation (per role: the prefill and
    decode placements must not share one counter, or two prefill engines never alternate)."""
    p0, p1, d0 = sim_factory.start_many([list(PREFILL), list(PREFILL), list(DECODE)])
    rr = await start_router(two_prefill(p0, p1, d0), admin={"token": TOKEN})
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    await admin.drain("p0")
    status, body = await admin.readmit("p0")
    assert status == 200, body
    for sim in (p0, p1):
        await asyncio.to_thread(sim.clear_requests)  # readmission's own probe legs
    await send(http, rr.url, 6)  # one after another: every placement is a tie
    assert await asyncio.to_thread(prefill_legs, p0) == 3
    assert await asyncio.to_thread(prefill_legs, p1) == 3
