"""The control pool under contention: waiting for a control connection is never the engine's
fault (DESIGN §2: "the control pool timed out" is inconclusive; §1: under overload no healthy
engine is ejected).

Real fault: a SIGSTOPped engine keeps its socket and answers nothing, so each health check to
it holds a control connection for the whole health timeout. With one control connection, the
other engines' checks queue behind it; they must come out as `busy` (no evidence), never as
silent engines.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.clock import SystemClock
from narwhal.config import EngineConfig, Role
from narwhal.control.health import Answer, check_health
from narwhal.engine.failures import FailureClass
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient
from narwhal.fleet.state import EngineState
from tests.support.poll import eventually
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory

PREFILL = ("--role", "prefill", "--kv-role", "kv_producer")
DECODE = ("--role", "decode", "--kv-role", "kv_consumer")


async def _control_in_use(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "narwhal_pool_connections_in_use" and sample.labels == {
                "pool": "control"
            }:
                return sample.value
    raise AssertionError("narwhal_pool_connections_in_use{pool=control} not exported")


def _state(engine_id: str, url: str, role: Role) -> EngineState:
    return EngineState(config=EngineConfig(id=engine_id, url=url, role=role), role=role)


async def test_a_check_that_cannot_get_a_control_connection_is_busy_not_silent(
    sim_factory: SimFactory,
) -> None:
    frozen_sim, healthy_sim = sim_factory.start_many([list(PREFILL), list(DECODE)])
    frozen = _state("p0", frozen_sim.url, Role.PREFILL)
    healthy = _state("d0", healthy_sim.url, Role.DECODE)
    client = EngineClient(data_limit=4, control_limit=1)
    await client.start()
    adapters = Adapters(client, SystemClock(), 1.0)
    try:
        frozen_sim.freeze()
        stuck = asyncio.create_task(check_health(client, adapters, frozen, 2.0))
        await eventually(lambda: client.control_in_use == 1, what="the frozen check holds it")
        result = await check_health(client, adapters, healthy, 0.2)
        assert result.answer is Answer.BUSY, result
        assert (await stuck).answer is Answer.SILENT  # the frozen engine itself is silent
        assert client.control_in_use == 0
        assert (await check_health(client, adapters, healthy, 2.0)).answer is Answer.OK
    finally:
        frozen_sim.thaw()
        await client.close()


@pytest.mark.slow
async def test_healthy_engines_queued_behind_a_frozen_one_gather_no_evidence(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    prefill, d0, d1 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    fleet: list[dict[str, Any]] = [
        {"id": "p0", "url": prefill.url, "role": "prefill"},
        {"id": "d0", "url": d0.url, "role": "decode"},
        {"id": "d1", "url": d1.url, "role": "decode"},
    ]
    rr = await start_router(
        fleet,
        engine={"control_connections": 1, "health_timeout_s": 0.3},
        recovery={"eject_after": 2, "liveness_misses": 2},
    )
    router = rr.router
    await eventually(lambda: router.monitor.status.passes >= 1, what="a first pass")
    prefill.freeze()
    try:
        start = router.monitor.status.passes
        # p0 goes first in every sweep and holds the only control connection for 0.3 s.
        await eventually(
            lambda: router.monitor.status.passes >= start + 4, timeout_s=20, what="four passes"
        )
        for engine_id in ("d0", "d1"):
            state = router.fleet.get(engine_id)
            assert state.ejected is None, state.ejected
            assert FailureClass.TIMEOUT not in state.evidence
            assert state.liveness_misses == 0
        assert router.fleet.get("p0").ejected is not None  # the frozen engine is still caught
    finally:
        prefill.thaw()


async def test_a_suspect_probe_that_cannot_get_a_control_connection_ejects_nothing(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    fleet: list[dict[str, Any]] = [
        {"id": "p0", "url": prefill.url, "role": "prefill"},
        {"id": "d0", "url": decode.url, "role": "decode"},
    ]
    rr = await start_router(fleet, engine={"control_connections": 1, "health_timeout_s": 0.2})
    router = rr.router
    # Something else holds the only control connection for longer than the probe may wait.
    async with router.client.control_slot(5.0):
        assert await _control_in_use(rr.url) == 1.0  # exported, read at scrape time
        await router.suspects.probe("d0", FailureClass.TIMEOUT)
    assert router.fleet.get("d0").ejected is None
    # With the connection free, the same probe runs and a healthy engine passes it.
    await router.suspects.probe("d0", FailureClass.TIMEOUT)
    assert router.fleet.get("d0").ejected is None
