"""Readmission of engines that export no process generation (no `process_start_time_seconds`).

Spec: readmission verifies generation identity (not older than last seen, strictly newer under
planned maintenance). Engines other than narwhal-sim may export no `/metrics` at all: such an
engine must still come back, with the step reported honestly as `unknown`; planned maintenance
on it ends once the engine went silent on `/health` and answered again (docs/readmission.md).
The engine here is narwhal-sim behind a proxy that answers 404 on `/metrics`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.e2e.test_readmission_support import (
    DECODE,
    PREFILL,
    TOKEN,
    Admin,
    EngineFront,
    assert_failed_at,
    engine,
    hold_names,
    in_service,
)
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory

UNKNOWN = "generation unknown (engine exports no process_start_time_seconds)"


@pytest.fixture
async def front(sim_factory: SimFactory) -> AsyncIterator[EngineFront]:
    """A prefill sim whose proxy hides `/metrics` (404)."""
    sim = sim_factory(*PREFILL)
    f = await EngineFront(sim.url).start()
    f.answer["/metrics"] = 404
    yield f
    await f.close()


def generation_step(e: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in e["readmission"] if s["step"] == "generation_identity")


async def _router(
    front: EngineFront,
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    liveness_misses: int,
) -> Admin:
    """p0 behind `front`, a sim as d0, and the admin API once the router is ready."""
    d0 = sim_factory(*DECODE)
    rr = await start_router(
        [engine("p0", front.url, "prefill"), engine("d0", d0.url, "decode")],
        admin={"token": TOKEN},
        recovery={"eject_after": 1000, "liveness_misses": liveness_misses},
    )
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    return admin


@pytest.mark.slow
async def test_an_ejected_engine_without_metrics_is_readmitted_with_generation_unknown(
    front: EngineFront,
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    admin = await _router(front, sim_factory, start_router, http, liveness_misses=2)
    await admin.wait_engine("p0", in_service, "in service")
    port = int(front.url.rsplit(":", 1)[1])
    await front.close()  # silent: ejected by liveness
    await admin.wait_engine("p0", lambda e: e["ejected"] is True, "ejected by liveness")
    e = await admin.engine("p0")
    assert e["generation"] is None, e
    await front.start(port)

    e = await admin.wait_engine("p0", in_service, "readmitted by itself", timeout_s=30)
    assert e["readmission"] and all(s["ok"] for s in e["readmission"]), e["readmission"]
    step = generation_step(e)
    assert step == {
        "step": "generation_identity",
        "ok": True,
        "status": "unknown",
        "reason": UNKNOWN,
    }, step


@pytest.mark.slow
async def test_maintenance_on_an_engine_without_metrics_ends_after_it_restarts(
    front: EngineFront,
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    admin = await _router(front, sim_factory, start_router, http, liveness_misses=1000)
    await admin.wait_engine("p0", in_service, "in service")
    await admin.maintenance("p0")

    # Still the same process: refused, by the operator and by the monitor.
    status, body = await admin.readmit("p0")
    assert status == 409 and body["readmitted"] is False, body
    assert_failed_at(body["steps"], "generation_identity", "needs a restart")
    await admin.wait_passes(10)
    e = await admin.engine("p0")
    assert hold_names(e) == ["planned_maintenance"] and e["eligible"] is False, e
    assert_failed_at(e["readmission"], "generation_identity", "needs a restart")

    # The "engine" restarts: its port closes (silence on /health) and opens again.
    port = int(front.url.rsplit(":", 1)[1])
    await front.close()
    await admin.wait_passes(5)  # health sweeps see the refused connections
    await front.start(port)
    assert front.url.endswith(f":{port}")

    e = await admin.wait_engine("p0", in_service, "back in service by itself", timeout_s=30)
    assert e["holds"] == [], e
    step = generation_step(e)
    assert step["ok"] is True and step["status"] == "unknown", step
    assert step["reason"].startswith(UNKNOWN) and "restarted" in step["reason"], step


@pytest.mark.slow
async def test_an_engine_whose_generation_was_seen_and_now_is_not_stays_out(
    front: EngineFront,
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """Something changed: an engine that exported its generation and no longer does."""
    del front.answer["/metrics"]
    admin = await _router(front, sim_factory, start_router, http, liveness_misses=2)
    await admin.wait_engine("p0", lambda e: e["generation"] is not None, "generation learned")
    port = int(front.url.rsplit(":", 1)[1])
    await front.close()
    await admin.wait_engine("p0", lambda e: e["ejected"] is True, "ejected by liveness")
    front.answer["/metrics"] = 404
    await front.start(port)

    e = await admin.wait_engine(
        "p0", lambda e: bool(e["readmission"]) and len(e["readmission"]) >= 4, "an attempt"
    )
    last = assert_failed_at(
        e["readmission"], "generation_identity", "process_start_time_seconds missing"
    )
    assert "was seen before" in last["reason"], last
    await admin.wait_passes(10)
    e = await admin.engine("p0")
    assert e["ejected"] is True, e
