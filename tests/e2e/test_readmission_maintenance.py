"""Planned maintenance end to end: drain now, come back only as a newer process.

Spec chapter "Failure, readmission, and state", section "Readmission and drains": planned
maintenance adds a newer-process requirement. DESIGN §2: generation identity is
`process_start_time_seconds` from the engine's `/metrics`; under planned maintenance it must
be strictly newer; engines under `planned_maintenance` come back automatically once a newer
process passes (the `readmission` monitor stage), with the hold cleared.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.e2e.test_readmission_support import (
    DECODE,
    SLOW_PREFILL,
    TOKEN,
    Admin,
    EngineFront,
    assert_failed_at,
    burst_share,
    engine,
    hold_names,
    in_service,
    two_prefill,
)
from tests.support.poll import eventually
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory


@pytest.mark.slow
async def test_maintenance_drains_refuses_the_same_process_and_a_restart_returns_by_itself(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    rr = await start_router(two_prefill(p0, p1, d0), admin={"token": TOKEN})
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    gen0 = await asyncio.to_thread(p0.process_start_time)
    await admin.wait_engine("p0", lambda e: e["generation"] == gen0, "generation learned")

    await admin.maintenance("p0")
    e = await admin.engine("p0")
    assert hold_names(e) == ["planned_maintenance"] and e["eligible"] is False
    assert str(gen0) in e["hold_details"][0]["reason"]
    assert await burst_share(http, rr.url, [p0, p1]) == [0, 6]  # no new traffic

    # The same process is refused, by the operator and by the monitor's readmission stage.
    status, body = await admin.readmit("p0")
    assert status == 409 and body["readmitted"] is False, body
    last = assert_failed_at(body["steps"], "generation_identity", "planned maintenance needs")
    assert str(gen0) in last["reason"]
    await admin.wait_passes(20)
    e = await admin.engine("p0")
    assert hold_names(e) == ["planned_maintenance"] and e["eligible"] is False
    assert e["drain_settled"] is True
    assert_failed_at(e["readmission"], "generation_identity", "planned maintenance needs")

    # A restarted process (same port, newer generation) comes back by itself.
    await asyncio.to_thread(p0.restart)
    gen1 = await asyncio.to_thread(p0.process_start_time)
    assert gen1 > gen0
    e = await admin.wait_engine("p0", in_service, "back in service by itself", timeout_s=20)
    assert e["generation"] == gen1
    assert e["readmission"] and all(s["ok"] for s in e["readmission"]), e["readmission"]
    assert set(e["evidence"].values()) == {0}
    assert min(await burst_share(http, rr.url, [p0, p1])) > 0


@pytest.mark.slow
async def test_maintenance_ends_when_the_engine_reports_a_newer_generation_in_place(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The sim's `restart` fault: same port and connection, newer process_start_time_seconds."""
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    rr = await start_router(two_prefill(p0, p1, d0), admin={"token": TOKEN})
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    gen0 = await asyncio.to_thread(p0.process_start_time)
    await admin.wait_engine("p0", lambda e: e["generation"] == gen0, "generation learned")
    await admin.maintenance("p0")
    await admin.wait_passes(5)
    assert hold_names(await admin.engine("p0")) == ["planned_maintenance"]
    await asyncio.to_thread(p0.add_fault, {"kind": "restart"})
    e = await admin.wait_engine("p0", in_service, "back in service by itself", timeout_s=15)
    assert e["generation"] > gen0
    # An operator drain, by contrast, never ends by itself (see test_readmission_drains).


@pytest.mark.slow
async def test_operator_readmission_of_a_restarted_engine_under_maintenance(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    # A long monitor interval: only the operator's request can readmit within the test.
    rr = await start_router(
        two_prefill(p0, p1, d0), admin={"token": TOKEN}, controller={"monitor_interval_s": 30}
    )
    admin = Admin(http, rr.url)
    gen0 = await asyncio.to_thread(p0.process_start_time)
    await admin.wait_engine("p0", lambda e: e["generation"] == gen0, "generation learned")
    await admin.maintenance("p0")
    await asyncio.to_thread(p0.add_fault, {"kind": "restart"})
    status, body = await admin.readmit("p0")
    assert status == 200 and body["readmitted"] is True, body
    e = await admin.engine("p0")
    assert e["holds"] == [] and e["eligible"] is True and e["generation"] > gen0


@pytest.mark.slow
async def test_maintenance_requested_before_the_generation_is_known_still_needs_a_newer_process(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    front = await EngineFront(p0.url).start()
    front.answer["/metrics"] = 503  # the engine's metrics are not readable for now
    try:
        engines = [engine("p0", front.url, "prefill"), *two_prefill(p0, p1, d0)[1:]]
        rr = await start_router(engines, admin={"token": TOKEN})
        admin = Admin(http, rr.url)
        await admin.wait_ready()
        await admin.wait_passes(3)
        assert (await admin.engine("p0"))["generation"] is None
        await admin.maintenance("p0")
        del front.answer["/metrics"]  # the same process, now with readable metrics
        await admin.wait_passes(20)
        e = await admin.engine("p0")
        assert hold_names(e) == ["planned_maintenance"], e
        status, body = await admin.readmit("p0")
        assert status == 409, body
        assert_failed_at(body["steps"], "generation_identity", "planned maintenance needs")
    finally:
        await front.close()


@pytest.mark.slow
async def test_maintenance_after_an_unnoticed_in_place_restart_still_needs_a_newer_process(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The baseline is the generation running at request time, read from the engine then, not
    the one the router saw last (the health stage records a generation only once)."""
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    rr = await start_router(two_prefill(p0, p1, d0), admin={"token": TOKEN})
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    gen0 = await asyncio.to_thread(p0.process_start_time)
    await admin.wait_engine("p0", lambda e: e["generation"] == gen0, "generation learned")
    await asyncio.to_thread(p0.add_fault, {"kind": "restart"})  # in place: nobody notices
    gen1 = await asyncio.to_thread(p0.process_start_time)
    assert gen1 > gen0
    await admin.wait_passes(2)
    assert (await admin.engine("p0"))["generation"] == gen0  # the router's record is stale

    await admin.maintenance("p0")
    e = await admin.engine("p0")
    assert e["generation"] == gen1, e
    assert e["hold_details"][0]["reason"] == f"planned maintenance at generation {gen1}", e
    await admin.wait_passes(10)  # automatic attempts see the same process gen1
    e = await admin.engine("p0")
    assert hold_names(e) == ["planned_maintenance"] and e["eligible"] is False, e
    assert_failed_at(e["readmission"], "generation_identity", f"newer than {gen1}")
    status, body = await admin.readmit("p0")
    assert status == 409, body
    assert_failed_at(body["steps"], "generation_identity", f"newer than {gen1}")
    assert hold_names(await admin.engine("p0")) == ["planned_maintenance"]

    await asyncio.to_thread(p0.add_fault, {"kind": "restart"})  # the real maintenance restart
    e = await admin.wait_engine("p0", in_service, "back in service by itself", timeout_s=20)
    assert e["generation"] > gen1


@pytest.mark.slow
async def test_the_maintenance_baseline_survives_a_router_resume(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Maintenance asked while the generation is unreadable: the baseline is the request time,
    kept in the handoff (`newer_than`), so the resumed router still refuses the same process
    (it knows no generation of its own to compare with) and accepts a restarted one."""
    p0, p1, d0 = sim_factory.start_many([list(SLOW_PREFILL), list(SLOW_PREFILL), list(DECODE)])
    front = await EngineFront(p0.url).start()
    front.answer["/metrics"] = 503
    try:
        engines = [engine("p0", front.url, "prefill"), *two_prefill(p0, p1, d0)[1:]]
        first = await start_router(engines, admin={"token": TOKEN})
        admin = Admin(http, first.url)
        await admin.wait_ready()
        await admin.maintenance("p0")

        async def saved_baseline() -> float | None:
            status, body = await admin.get("/admin/handoff")
            doc = body["document"] if status == 200 else None
            holds = doc["engines"]["p0"]["holds"] if doc else []
            held = [h for h in holds if h["name"] == "planned_maintenance"]
            return held[0].get("newer_than") if held else None

        baseline = await eventually(saved_baseline, timeout_s=10, what="baseline in the handoff")
        gen0 = await asyncio.to_thread(p0.process_start_time)
        assert baseline > gen0  # the request time: the running process started before it
        await first.stop()

        del front.answer["/metrics"]  # the same process, its generation readable now
        resumed = await start_router(
            engines, admin={"token": TOKEN}, router_kwargs={"resume": True}
        )
        verdict = resumed.router.resume_verdict
        assert verdict is not None and verdict.ok, verdict
        admin = Admin(http, resumed.url)
        await admin.wait_passes(15)
        e = await admin.engine("p0")
        assert hold_names(e) == ["planned_maintenance"] and e["eligible"] is False, e
        status, body = await admin.readmit("p0")
        assert status == 409, body
        assert_failed_at(body["steps"], "generation_identity", f"newer than {baseline}")

        await asyncio.to_thread(p0.add_fault, {"kind": "restart"})
        e = await admin.wait_engine("p0", in_service, "back in service by itself", timeout_s=20)
        assert e["generation"] > baseline
    finally:
        await front.close()
