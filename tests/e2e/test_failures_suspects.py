"""Two suspects verify each other, end to end (DESIGN §2; docs/failure-handling.md).

The only prefill engine and the only decode engine are both held for inference verification,
so neither has an eligible peer. Each probe then takes the other, held engine as its peer; once
the faults are gone a passing round trip clears both holds and /ready returns to 200 (before,
every probe was inconclusive and /ready stayed 503 for good).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]


async def engine(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> dict[str, Any]:
    async with http.get(rr.url + "/admin/engines") as resp:
        assert resp.status == 200
        body = await resp.json()
    return next(e for e in body["engines"] if e["id"] == engine_id)


async def complete(
    http: aiohttp.ClientSession, rr: RunningRouter, *, stream: bool = False
) -> tuple[int, bytes]:
    body = {"model": "demo-model", "prompt": "two suspects", "max_tokens": 8, "stream": stream}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def ready(http: aiohttp.ClientSession, rr: RunningRouter) -> tuple[int, str]:
    async with http.get(rr.url + "/ready") as resp:
        return resp.status, await resp.text()


def verifying(state: dict[str, Any]) -> bool:
    return "inference_verification" in state["holds"]


@pytest.mark.slow
async def test_the_only_prefill_and_decode_engines_held_together_clear_each_other(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": d0.url, "role": "decode"}],
        # No pass of its own after the first: both holds land before any probe runs, and
        # the test then drives the passes itself.
        controller={"monitor_interval_s": 300.0},
        recovery={"eject_after": 2, "liveness_misses": 50},
        serving={"stream_idle_timeout_s": 1.0},
    )  # fmt: skip
    passes = rr.router.monitor.status.passes
    await eventually(lambda: rr.router.monitor.status.passes > passes, what="a monitor pass")

    # Two streams pass p0's prefill and stall on d0 (each a `stream` failure once the idle
    # timeout fires); meanwhile two prefill legs fail on p0 with a 500.
    d0.add_fault({"kind": "stall_mid_stream", "after_tokens": 1, "delay_s": 5, "leg": "decode",
                  "count": 2})  # fmt: skip
    streams = [asyncio.create_task(complete(http, rr, stream=True)) for _ in range(2)]

    def decoding() -> bool:
        return sum(r["leg"] == "decode" for r in d0.requests()) == 2

    await eventually(decoding, timeout_s=5, what="both streams on d0")
    p0.add_fault({"kind": "completion_status", "status": 500, "leg": "prefill", "count": 2})
    assert [(await complete(http, rr))[0] for _ in range(2)] == [502, 502]
    assert verifying(await engine(http, rr, "p0"))
    for status, raw in await asyncio.gather(*streams):
        assert status == 200 and b"[DONE]" not in raw, raw

    p0_state, d0_state = await engine(http, rr, "p0"), await engine(http, rr, "d0")
    assert verifying(p0_state) and verifying(d0_state), "both held at once (before a pass)"
    assert (p0_state["evidence"]["inference_status"], d0_state["evidence"]["stream"]) == (2, 2)
    assert await ready(http, rr) == (503, "no capacity: prefill")
    status, raw = await complete(http, rr)
    assert status == 503
    assert json.loads(raw)["error"]["message"] == "no capacity: prefill"
    # Both faults are spent: the engines are well again, and only a probe can tell.
    assert [f["fired"] for f in p0.faults() + d0.faults()] == [2, 2]

    async def both_back() -> bool:
        await rr.router.monitor.run_pass(rr.router.clock.monotonic())
        states = [await engine(http, rr, e) for e in ("p0", "d0")]
        return all(s["eligible"] and not s["holds"] for s in states)

    await eventually(both_back, timeout_s=20, what="both engines eligible again")
    for engine_id in ("p0", "d0"):
        state = await engine(http, rr, engine_id)
        assert state["ejected"] is False
        assert set(state["evidence"].values()) == {0}, state
    assert await ready(http, rr) == (200, "ready")
    assert [(await complete(http, rr))[0] for _ in range(3)] == [200] * 3
