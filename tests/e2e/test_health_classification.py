"""How a health sweep classifies an answer that is not 200 (spec failure table; issue 4).

Real faults: a `narwhal-sim` whose `/health` answers a chosen status (`health_status`) or
hangs past the timeout (`health_hang`). 408/429 are `overload`, 5xx `inference_status`; any
other 4xx is no evidence and clears connection and inference-status evidence (spec's clearing
table), but is not "Health 200". An answer of any status makes the sweep not silent: it resets
the consecutive-miss counter.
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
        # Nothing hangs here: a generous timeout, so that a check slowed by a loaded machine
        # is not a silent sweep (with liveness_misses 1 it would eject).
        engine={"health_timeout_s": 5.0},
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


def _fired(sim: SimProcess, fault_id: int) -> int:
    return int(next(f["fired"] for f in sim.faults() if f["id"] == fault_id))


async def test_a_health_4xx_clears_connection_and_inference_status_but_is_not_health_200(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Timeout evidence (one silent sweep), then inference_status (503s), then 404s: the 404
    clears inference_status, adds nothing, and leaves the timeout streak (only a 200 clears
    it)."""
    prefill, decode = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        _fleet(prefill, decode),
        engine={"health_timeout_s": HEALTH_TIMEOUT_S},
        recovery={"liveness_misses": 1000, "eject_after": 1000},
    )
    await _sweeps(rr, 1)
    decode.add_fault({"kind": "health_hang", "delay_s": 3 * HEALTH_TIMEOUT_S, "count": 1})
    decode.add_fault({"kind": "health_status", "status": 503, "count": 2})
    decode.add_fault({"kind": "health_status", "status": 404})

    async def evidence() -> dict[str, int]:
        state = await _engine(http, rr, "d0")
        return {cls: n for cls, n in state["evidence"].items() if n}

    async def had_503s() -> bool:
        return (await evidence()).get("inference_status", 0) >= 2

    await eventually(had_503s, timeout_s=15, what="two 503 sweeps")
    await _sweeps(rr, SWEEPS)
    assert await evidence() == {"timeout": 1}
    state = await _engine(http, rr, "d0")
    assert state["ejected"] is False and state["liveness_misses"] == 0


async def test_an_answered_sweep_breaks_a_run_of_silent_sweeps(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Silent, 503, silent, silent with `liveness_misses: 3`: never three consecutive silent
    sweeps, so no ejection (a hang fault fires before a status fault)."""
    prefill, decode = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        _fleet(prefill, decode),
        engine={"health_timeout_s": HEALTH_TIMEOUT_S},
        recovery={"liveness_misses": 3, "eject_after": 1000},
    )
    await _sweeps(rr, 1)
    hang = {"kind": "health_hang", "delay_s": 3 * HEALTH_TIMEOUT_S}
    decode.add_fault({"kind": "health_status", "status": 503})
    decode.add_fault({**hang, "count": 1})

    async def answered_after_silence() -> bool:
        state = await _engine(http, rr, "d0")
        return state["evidence"].get("timeout", 0) >= 1 and state["liveness_misses"] == 0

    await eventually(answered_after_silence, timeout_s=15, what="a 503 after a silent sweep")
    second = decode.add_fault({**hang, "count": 2})["id"]
    await eventually(lambda: _fired(decode, second) == 2, timeout_s=15, what="two more hangs")
    await _sweeps(rr, 3)
    state = await _engine(http, rr, "d0")
    assert state["ejected"] is False, state["ejection"]
    assert state["liveness_misses"] == 0  # the 503s since reset it
    # A 200 keeps it at zero.
    decode.clear_faults()
    await _sweeps(rr, 2)
    assert (await _engine(http, rr, "d0"))["liveness_misses"] == 0
