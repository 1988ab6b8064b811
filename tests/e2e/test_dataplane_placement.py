"""Placement over real engines: least in-flight first, ties broken in rotation (DESIGN §1)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"


@pytest.fixture(scope="module")
def shared() -> Iterator[list[SimProcess]]:
    """p0, p1, d0, d1; the decode engines stream at 50 ms per token."""
    factory = SimFactory()
    p = ["--role", "prefill", "--kv-role", "kv_producer"]
    d = ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "50"]
    try:
        yield factory.start_many([p, p, d, d])
    finally:
        factory.close()


async def _running(sim: SimProcess) -> float:
    return await asyncio.to_thread(sim.metric, "vllm:num_requests_running")


@pytest.fixture
async def rr(shared: list[SimProcess], start_router: StartRouter) -> RunningRouter:
    for sim in shared:

        async def idle(s: SimProcess = sim) -> bool:
            return await _running(s) == 0

        await eventually(idle, timeout_s=5, what="sim idle")
        sim.clear_faults()
        sim.clear_requests()
    names = ["p0", "p1", "d0", "d1"]
    return await start_router(
        [{"id": n, "url": s.url, "role": "prefill" if n[0] == "p" else "decode"}
         for n, s in zip(names, shared, strict=True)]
    )  # fmt: skip


async def _quick(http: aiohttp.ClientSession, rr: RunningRouter) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "quick one", "max_tokens": 1}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.read()


async def test_sequential_requests_rotate_over_the_engines_of_each_role(
    rr: RunningRouter, shared: list[SimProcess], http: aiohttp.ClientSession
) -> None:
    for _ in range(4):
        await _quick(http, rr)
    prefill = [len(s.requests()) for s in shared[:2]]
    decode = [len(s.requests()) for s in shared[2:]]
    assert (prefill, decode) == ([2, 2], [2, 2])


async def test_least_in_flight_engine_is_chosen_first(
    rr: RunningRouter, shared: list[SimProcess], http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "a long stream", "max_tokens": 60, "stream": True}
    resp = await http.post(rr.url + "/v1/completions", json=body)
    try:
        assert resp.status == 200
        await resp.content.readany()  # streaming: its decode engine has one in flight
        busy = next(s for s in shared[2:] if s.requests())
        idle = next(s for s in shared[2:] if s is not busy)
        for _ in range(3):
            await _quick(http, rr)
        assert len(idle.requests()) == 3
        assert len(busy.requests()) == 1
    finally:
        resp.close()
