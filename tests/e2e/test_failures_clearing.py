"""Which success clears which failure evidence, end to end (spec "Clearing failure evidence").

One prefill and one decode engine (placement is then deterministic). Evidence of several
classes is built on one engine with one-shot real faults, each below `recovery.eject_after`
so no action interferes; then one success of a kind must clear exactly the classes the
spec's table lists and keep the others. Monitor sweeps are kept out of the way (a health 200
clears evidence too) except in the health row, which needs them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]
CLASSES = ("connection", "timeout", "stream", "overload", "inference_status", "kv_handoff")
NO_SWEEPS = {"monitor_interval_s": 30.0}


def fleet(prefills: list[SimProcess], decodes: list[SimProcess]) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "url": s.url, "role": "prefill"} for i, s in enumerate(prefills)] + [
        {"id": f"d{i}", "url": s.url, "role": "decode"} for i, s in enumerate(decodes)
    ]


async def engine(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> dict[str, Any]:
    async with http.get(rr.url + "/admin/engines") as resp:
        body = await resp.json()
    return next(e for e in body["engines"] if e["id"] == engine_id)


async def evidence(
    http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str
) -> dict[str, int]:
    return dict((await engine(http, rr, engine_id))["evidence"])


def only(**streaks: int) -> dict[str, int]:
    """A full evidence map: the given streaks, every other class 0."""
    return {c: streaks.get(c, 0) for c in CLASSES}


async def complete(
    http: aiohttp.ClientSession, rr: RunningRouter, *, stream: bool = False, prompt: str = "clear"
) -> tuple[int, bytes]:
    body = {"model": "demo-model", "prompt": prompt, "max_tokens": 4, "stream": stream}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def fail_once(
    http: aiohttp.ClientSession, rr: RunningRouter, sim: SimProcess, fault: dict[str, Any],
    *, stream: bool = False,
) -> int:  # fmt: skip
    """Inject a one-shot fault, send one request that meets it; returns the client's status."""
    sim.add_fault({**fault, "count": 1})
    status, _ = await complete(http, rr, stream=stream)
    assert all(f["fired"] == 1 for f in sim.faults()), sim.faults()
    sim.clear_faults()
    return status


PREFILL_FAULTS: dict[str, dict[str, Any]] = {
    "connection": {"kind": "reset_connections", "leg": "prefill"},
    "inference_status": {"kind": "completion_status", "status": 500, "leg": "prefill"},
    "kv_handoff": {"kind": "handoff_garbage", "leg": "prefill"},
    "overload": {"kind": "completion_status", "status": 429, "leg": "prefill"},
    "stream": {"kind": "stall_first_token", "delay_s": 3, "leg": "prefill"},  # first-token deadline
}
DECODE_FAULTS: dict[str, dict[str, Any]] = {
    "connection": {"kind": "reset_connections", "leg": "decode"},
    "inference_status": {"kind": "completion_status", "status": 500, "leg": "decode"},
    "overload": {"kind": "completion_status", "status": 429, "leg": "decode"},
    "stream": {"kind": "no_done", "leg": "decode"},  # invalid stream termination
}


async def build_prefill_evidence(http: aiohttp.ClientSession, rr: RunningRouter,
                                 p0: SimProcess) -> None:  # fmt: skip
    for fault in PREFILL_FAULTS.values():
        assert await fail_once(http, rr, p0, fault) in (502, 503, 504)
    assert await evidence(http, rr, "p0") == only(
        connection=1, inference_status=1, kv_handoff=1, overload=1, stream=1
    )


@pytest.fixture
async def pd(
    sim_factory: SimFactory, start_router: StartRouter
) -> tuple[RunningRouter, SimProcess, SimProcess]:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        fleet([p0], [d0]),
        controller=NO_SWEEPS,
        recovery={"eject_after": 5},
        serving={"first_token_timeout_s": 0.3},
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    return rr, p0, d0


async def test_a_prefill_with_an_extracted_handoff_clears_connection_inference_and_handoff(
    pd: tuple[RunningRouter, SimProcess, SimProcess], http: aiohttp.ClientSession
) -> None:
    rr, p0, _ = pd
    await build_prefill_evidence(http, rr, p0)
    status, raw = await complete(http, rr)
    assert status == 200, raw
    assert await evidence(http, rr, "p0") == only(overload=1, stream=1)


async def test_a_decode_stream_reaching_done_clears_connection_inference_and_stream(
    pd: tuple[RunningRouter, SimProcess, SimProcess], http: aiohttp.ClientSession
) -> None:
    rr, _, d0 = pd
    for cls, fault in DECODE_FAULTS.items():
        status = await fail_once(http, rr, d0, fault, stream=cls == "stream")
        assert status in (200, 502, 503), (cls, status)  # a broken stream is a 200 that fails
    assert await evidence(http, rr, "d0") == only(
        connection=1, inference_status=1, stream=1, overload=1
    )
    status, raw = await complete(http, rr, stream=True)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    assert await evidence(http, rr, "d0") == only(overload=1)


async def test_a_client_4xx_clears_connection_and_inference_status_only(
    pd: tuple[RunningRouter, SimProcess, SimProcess], http: aiohttp.ClientSession
) -> None:
    rr, p0, _ = pd
    await build_prefill_evidence(http, rr, p0)
    status, raw = await complete(http, rr, prompt="")  # the engine answers 400
    assert status == 400, raw
    assert b"prompt cannot be empty" in raw, "the engine's own 400 body is passed through"
    assert await evidence(http, rr, "p0") == only(kv_handoff=1, overload=1, stream=1)


@pytest.mark.parametrize("status", [408, 429])
async def test_an_overload_answer_is_not_a_client_4xx_and_clears_nothing(
    pd: tuple[RunningRouter, SimProcess, SimProcess], http: aiohttp.ClientSession, status: int
) -> None:
    rr, p0, _ = pd
    await fail_once(http, rr, p0, PREFILL_FAULTS["connection"])
    await fail_once(http, rr, p0, PREFILL_FAULTS["inference_status"])
    assert (
        await fail_once(
            http, rr, p0, {"kind": "completion_status", "status": status, "leg": "prefill"}
        )
        == 503
    )
    assert await evidence(http, rr, "p0") == only(connection=1, inference_status=1, overload=1)


@pytest.mark.slow
async def test_health_200_clears_connection_timeout_overload_and_liveness(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        fleet([p0], [d0]),
        controller={"monitor_interval_s": 1.5},
        recovery={"eject_after": 5, "liveness_misses": 5},
        engine={"health_timeout_s": 0.3},
    )
    passes = rr.router.monitor.status.passes
    await eventually(lambda: rr.router.monitor.status.passes > passes, what="a pass")
    # Between two sweeps: data-path evidence, and a /health that will hang past its timeout.
    for cls in ("connection", "inference_status", "kv_handoff", "overload"):
        await fail_once(http, rr, p0, PREFILL_FAULTS[cls])
    p0.add_fault({"kind": "health_hang", "delay_s": 5, "count": 1})
    passes = rr.router.monitor.status.passes
    await eventually(lambda: rr.router.monitor.status.passes > passes, timeout_s=5, what="sweep")
    state = await engine(http, rr, "p0")
    assert state["evidence"] == only(
        connection=1, inference_status=1, kv_handoff=1, overload=1, timeout=1
    )
    assert state["liveness_misses"] == 1

    passes = rr.router.monitor.status.passes
    await eventually(lambda: rr.router.monitor.status.passes > passes, timeout_s=5, what="sweep")
    state = await engine(http, rr, "p0")
    assert state["evidence"] == only(inference_status=1, kv_handoff=1)
    assert state["liveness_misses"] == 0


# ------------------------------------------------------------------ streaks per engine and class
async def test_streaks_are_per_class_so_mixed_failures_take_no_action(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        fleet([p0], [d0]), controller=NO_SWEEPS, recovery={"eject_after": 2},
        serving={"first_token_timeout_s": 0.3},
    )  # fmt: skip
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    for fault in PREFILL_FAULTS.values():  # five failures in a row, one of each class
        await fail_once(http, rr, p0, fault)
    state = await engine(http, rr, "p0")
    assert state["evidence"] == only(
        connection=1, inference_status=1, kv_handoff=1, overload=1, stream=1
    )
    assert state["ejected"] is False and state["holds"] == []
    assert (await complete(http, rr))[0] == 200


async def test_streaks_are_consecutive_a_clearing_success_restarts_them(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(fleet([p0], [d0]), controller=NO_SWEEPS, recovery={"eject_after": 2})
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    for _ in range(4):  # 500, success, 500, success, ...: never two in a row
        assert await fail_once(http, rr, d0, DECODE_FAULTS["inference_status"]) == 502
        assert (await engine(http, rr, "d0"))["evidence"]["inference_status"] == 1
        assert (await complete(http, rr))[0] == 200
        assert (await engine(http, rr, "d0"))["evidence"]["inference_status"] == 0
    state = await engine(http, rr, "d0")
    assert state["holds"] == [] and state["ejected"] is False


async def test_streaks_are_per_engine(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """One 5xx on each of two prefill engines, eject_after 2: neither is held."""
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    rr = await start_router(
        fleet([p0, p1], [d0]), controller=NO_SWEEPS, recovery={"eject_after": 2}
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    # One burst of two concurrent requests, one per prefill engine, both failing: no prefill
    # success comes between the two failures. (Retried until a burst splits that way.)
    for _ in range(10):
        for sim in (p0, p1):
            sim.clear_faults()
            sim.add_fault({**PREFILL_FAULTS["inference_status"], "count": 1})
        statuses = [s for s, _ in await asyncio.gather(*(complete(http, rr) for _ in range(2)))]
        if statuses == [502, 502]:
            break
    else:
        raise AssertionError("no burst reached both prefill engines")
    for engine_id in ("p0", "p1"):
        state = await engine(http, rr, engine_id)
        assert state["evidence"] == only(inference_status=1)
        assert state["holds"] == [] and state["ejected"] is False
