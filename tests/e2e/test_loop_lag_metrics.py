"""Whose event loop each lag histogram watches: with data-plane workers,
`narwhal_event_loop_lag_seconds` sums the workers' loops and the control process's own loop
(the lease, the monitor, the handoff) is `narwhal_control_event_loop_lag_seconds`; with one
process there is one loop, exported under both names, observation for observation."""

from __future__ import annotations

import aiohttp
import pytest

from tests.support.http import metric_sum
from tests.support.poll import eventually
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]
FAMILIES = ("event_loop_lag", "event_loop_stall")


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_control_loop_is_watched_in_every_mode(
    workers: int, sim_factory: SimFactory, start_router: StartRouter
) -> None:
    prefill, decode = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [
            {"id": "p0", "url": prefill.url, "role": "prefill"},
            {"id": "d0", "url": decode.url, "role": "decode"},
        ],
        serving={"workers": workers},
    )

    async def counts() -> dict[str, float] | None:
        async with aiohttp.ClientSession() as http, http.get(rr.url + "/metrics") as resp:
            text = await resp.text()
        out = {}
        for family in FAMILIES:
            out[family] = metric_sum(text, f"narwhal_{family}_seconds_count")
            out[f"control_{family}"] = metric_sum(text, f"narwhal_control_{family}_seconds_count")
        return out if all(v >= 3 for v in out.values()) else None

    seen = await eventually(counts, timeout_s=10, what="every loop watched")
    if workers == 1:  # one loop, one watcher, both names
        for family in FAMILIES:
            assert seen[family] == seen[f"control_{family}"], seen
