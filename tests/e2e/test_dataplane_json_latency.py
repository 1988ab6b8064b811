"""A non-streamed decode leg is a latency sample, so drift sees a slow decode engine whose
clients do not stream (issue 9).

A streamed decode records the time to its first chunk; a non-streamed decode's first byte is
its whole answer, and that time is its sample. Without it, a decode engine serving only JSON
clients had no samples and could never get a `performance_drift` hold.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "1"]
SLOW_DECODE = ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "40"]
MAX_TOKENS = 4  # 3 inter-token gaps: ~3 ms on the fast decode, ~120 ms on the slow one
CONTROLLER = {
    "interval_s": 1.0,
    "drift_min_samples": 3,
    "drift_intervals": 2,
    "drift_factor": 3,
    "drift_hold_s": 30,
    "drift_mode": "enforce",
}


async def _complete(http: aiohttp.ClientSession, rr: RunningRouter) -> int:
    body = {"model": "demo-model", "prompt": "json latency", "max_tokens": MAX_TOKENS}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


async def test_a_non_streamed_decode_records_its_leg_time_as_a_latency_sample(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, SLOW_DECODE])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": d0.url, "role": "decode"}],
        controller={"interval_s": 60.0},
    )  # fmt: skip
    for _ in range(2):
        assert await _complete(http, rr) == 200
    # (With data-plane workers the samples reach the control process within 0.25 s.)
    await eventually(
        lambda: (
            "d0" in rr.router.stats.current.engines
            and rr.router.stats.current.engines["d0"].latency.total == 2
        ),
        what="two latency samples",
    )
    window = rr.router.stats.current.engines["d0"]
    p50 = window.latency.quantile(0.5)
    assert p50 is not None and p50 >= 0.1  # the whole decode (3 gaps of 40 ms), not ~0


async def test_a_slow_decode_behind_json_clients_gets_a_drift_hold(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0, d1, d2 = sim_factory.start_many([PREFILL, DECODE, DECODE, SLOW_DECODE])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": d0.url, "role": "decode"},
         {"id": "d1", "url": d1.url, "role": "decode"},
         {"id": "d2", "url": d2.url, "role": "decode"}],
        controller=CONTROLLER,
    )  # fmt: skip
    statuses: list[int] = []

    async def worker() -> None:
        while True:
            statuses.append(await _complete(http, rr))

    workers = [asyncio.create_task(worker()) for _ in range(4)]
    try:
        await eventually(
            lambda: "performance_drift" in rr.holds("d2"), timeout_s=20, what="d2 drift hold"
        )
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    assert set(statuses) == {200}
    assert rr.holds("d0") == [] and rr.holds("d1") == []
