"""A readmission attempt never holds up the monitor pass.

Spec "Failure, readmission, and state": a monitor pass runs its stages independently and must
not be delayed by slow engines beyond the health timeout. The `readmission` stage only starts
attempts (one per engine at a time, in the router's task group); each attempt's result is
applied when it ends. Here an ejected engine answers `/health` but stalls its completions, so
its attempt waits at `kv_transfer` for `engine.probe_timeout_s`, while passes keep their pace.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import aiohttp
import pytest

from tests.e2e.test_readmission_support import (
    DECODE,
    PREFILL,
    Admin,
    assert_failed_at,
    metric,
    prefill_legs,
)
from tests.support.poll import eventually
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory

INTERVAL_S = 0.2
HEALTH_TIMEOUT_S = 0.5
PROBE_TIMEOUT_S = 6.0
MARGIN_S = 1.0  # generous: two cores shared by many test runs


def gaps(monitor: dict[str, Any]) -> list[float]:
    starts = sorted(p["started_at"] for p in monitor["last_passes"])
    return [b - a for a, b in itertools.pairwise(starts)]


@pytest.mark.slow
async def test_a_stalled_readmission_attempt_does_not_delay_monitor_passes(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.readmission")
    p0, p1, d0 = sim_factory.start_many([list(PREFILL), list(PREFILL), list(DECODE)])
    engines = [
        {"id": "p0", "url": p0.url, "role": "prefill"},
        {"id": "p1", "url": p1.url, "role": "prefill"},
        {"id": "d0", "url": d0.url, "role": "decode"},
    ]
    rr = await start_router(
        engines,
        controller={"monitor_interval_s": INTERVAL_S},
        engine={"health_timeout_s": HEALTH_TIMEOUT_S, "probe_timeout_s": PROBE_TIMEOUT_S},
    )
    admin = Admin(http, rr.url, token=None)
    await admin.wait_ready()

    # p0 stalls every prefill leg, then goes silent long enough to be ejected (liveness).
    await asyncio.to_thread(p0.add_fault, {"kind": "stall_first_token", "leg": "prefill"})
    legs_before = await asyncio.to_thread(prefill_legs, p0)
    await asyncio.to_thread(p0.add_fault, {"kind": "refuse_connections", "duration_s": 2.0})
    await admin.wait_engine("p0", lambda e: e["ejected"] is True, "ejected", timeout_s=20)

    # Its port reopens and /health answers 200: an attempt starts and hangs at kv_transfer.
    async def attempt_stalled() -> bool:
        try:
            return await asyncio.to_thread(prefill_legs, p0) > legs_before
        except OSError:  # the sim's own API is refused too while its port is closed
            return False

    await eventually(attempt_stalled, timeout_s=20, what="p0's readmission prefill leg")
    before = (await admin.monitor())["passes"]
    await admin.wait_passes(8, timeout_s=PROBE_TIMEOUT_S - 1)  # well inside one attempt
    monitor = await admin.monitor()
    recent = [p for p in monitor["last_passes"] if p["pass"] > before]
    assert len(recent) >= 8, monitor
    longest = max(gaps({"last_passes": recent}))
    assert longest < INTERVAL_S + HEALTH_TIMEOUT_S + MARGIN_S, gaps(monitor)
    for p in recent:
        stage = next(s for s in p["stages"] if s["stage"] == "readmission")
        assert stage["ok"] and stage["duration_s"] < 0.5, stage
    assert (await admin.engine("p0"))["ejected"] is True  # the attempt is still running

    # When the attempt ends, its result is applied: refused at kv_transfer, still ejected.
    def reported(e: dict[str, Any]) -> bool:
        return any(s["step"] == "kv_transfer" for s in e["readmission"])

    e = await admin.wait_engine("p0", reported, "attempt reported", timeout_s=PROBE_TIMEOUT_S + 10)
    last = assert_failed_at(e["readmission"], "kv_transfer", "")
    assert last["reason"] == "stream: deadline exceeded", last  # the stalled prefill leg
    # The log says the same: step and reason.
    lines = [r.getMessage() for r in caplog.records if r.name == "narwhal.readmission"]
    assert f"engine p0 readmission failed at kv_transfer: {last['reason']}" in lines, lines
    assert e["ejected"] is True and e["eligible"] is False
    text = await admin.metrics()
    assert metric(text, "narwhal_readmissions_total", engine="p0", result="failed",
                  step="kv_transfer") >= 1  # fmt: skip
