"""How a health sweep classifies an answer that is not 200 (spec failure table; issue 4).

Real faults: a `narwhal-sim` whose `/health` answers a chosen status (`health_status`) or
hangs past the timeout once (`health_hang`). 408/429 are `overload`, 5xx and any other 4xx are
`inference_status` (docs/failure-handling.md says why a health 4xx is not the client's); an
answer of any status is a sign of life: neither a liveness miss nor a liveness reset.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]
HEALTH_TIMEOUT_S = 0.4
SWEEPS = 4


def _fleet(prefill: SimProcess, decode: SimProcess) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": prefill.url, "role": "prefill"},
        {"id": "d0", "url": decode.url, "role": "decode"},
    ]


async def _engine(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> Any:
    async with http.get(rr.url + "/admin/engines") as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    return next(e for e in body["engines"] if e["id"] == engine_id)


async def _sweeps(rr: RunningRouter, count: int) -> None:
    start = rr.router.monitor.status.passes
    await eventually(
        lambda: rr.router.monitor.status.passes >= start + count,
        timeout_s=20,
        what=f"{count} more sweeps",
    )


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (429, "overload"),
        (408, "overload"),
        (503, "inference_status"),
        (500, "inference_status"),
        (404, "inference_status"),  # a 4xx to the router's own GET /health is no client's fault
    ],
)
async def test_a_non_200_health_answer_is_classified_and_is_alive(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    status: int,
    expected: str,
) -> None:
    """With `liveness_misses: 1` a single silent sweep would eject; answers of any status
    never count as one, and a high `eject_after` keeps the evidence from ejecting."""
    prefill, decode = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        _fleet(prefill, decode),
        engine={"health_timeout_s": HEALTH_TIMEOUT_S},
        recovery={"liveness_misses": 1, "eject_after": 1000},
    )
    await _sweeps(rr, 1)
    decode.add_fault({"kind": "health_status", "status": status})
    await _sweeps(rr, SWEEPS + 1)
    state = await _engine(http, rr, "d0")
    assert state["ejected"] is False, state["ejection"]
    assert state["liveness_misses"] == 0
    evidence = {cls: n for cls, n in state["evidence"].items() if n}
    assert set(evidence) == {expected}, evidence
    assert evidence[expected] >= SWEEPS
    # The healthy engine beside it is untouched.
    other = await _engine(http, rr, "p0")
    assert other["liveness_misses"] == 0 and not any(other["evidence"].values())


async def test_a_non_200_health_answer_neither_adds_nor_resets_a_liveness_miss(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        _fleet(prefill, decode),
        engine={"health_timeout_s": HEALTH_TIMEOUT_S},
        recovery={"liveness_misses": 3, "eject_after": 1000},
    )
    await _sweeps(rr, 1)
    # One silent sweep (the answer comes only after the timeout), then 503 on every sweep.
    decode.add_fault({"kind": "health_hang", "delay_s": 3 * HEALTH_TIMEOUT_S, "count": 1})
    decode.add_fault({"kind": "health_status", "status": 503})

    async def one_miss() -> bool:
        return (await _engine(http, rr, "d0"))["liveness_misses"] == 1

    await eventually(one_miss, timeout_s=10, what="one silent sweep")
    await _sweeps(rr, SWEEPS)
    state = await _engine(http, rr, "d0")
    assert state["liveness_misses"] == 1, "a 503 is not silent, and not a successful response"
    assert state["ejected"] is False
    assert state["evidence"]["inference_status"] >= SWEEPS
    # A 200 resets the counter.
    decode.clear_faults()

    async def reset() -> bool:
        return (await _engine(http, rr, "d0"))["liveness_misses"] == 0

    await eventually(reset, timeout_s=10, what="the counter reset by a 200")
