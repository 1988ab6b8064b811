"""The latency model, observed in-process through an injected sleeper (no real waiting)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from narwhal.clock import SystemClock
from narwhal.sim.config import SimConfig
from narwhal.sim.server import SimServer

from .helpers import PREFILL_KV

PROMPT = " ".join(f"w{i}" for i in range(40))  # 40 tokens: 3 KV blocks


@dataclass
class RecordingSleeper:
    """Records every wait and returns at once."""

    waits: list[float] = field(default_factory=list)

    async def __call__(self, seconds: float) -> None:
        self.waits.append(round(seconds, 9))
        await asyncio.sleep(0)


@dataclass
class InProcessSim:
    url: str
    sleeper: RecordingSleeper
    session: aiohttp.ClientSession

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body) as resp:
            text = await resp.text()
            is_json = resp.content_type == "application/json"
            return resp.status, (await resp.json()) if is_json else text


@pytest.fixture
async def sim() -> AsyncIterator[InProcessSim]:
    sleeper = RecordingSleeper()
    config = SimConfig(ttft_per_token_ms=2.0, itl_ms=5.0, transfer_per_block_ms=3.0)
    server = SimServer(config, clock=SystemClock(), rng=random.Random(1), sleeper=sleeper)
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(ready.set_result, stop))
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 10)
        async with aiohttp.ClientSession() as session:
            yield InProcessSim(url, sleeper, session)
    finally:
        stop.set()
        await task


async def test_unified_pays_ttft_per_prompt_token_then_itl_between_tokens(
    sim: InProcessSim,
) -> None:
    status, _ = await sim.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200
    assert sim.sleeper.waits == [0.08, 0.015]  # 40 x 2 ms, then 3 gaps x 5 ms at once


async def test_a_stream_waits_the_itl_before_every_token_but_the_first(sim: InProcessSim) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    status, _ = await sim.post("/v1/completions", body)
    assert status == 200
    assert sim.sleeper.waits == [0.08, 0.005, 0.005, 0.005]


async def test_a_decode_with_a_handoff_pays_transfer_per_block_not_ttft(sim: InProcessSim) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    status, prefill = await sim.post("/v1/completions", body)
    assert status == 200
    assert sim.sleeper.waits == [0.08]
    sim.sleeper.waits.clear()
    decode = {
        "prompt": PROMPT,
        "max_tokens": 2,
        "kv_transfer_params": prefill["kv_transfer_params"],
    }
    status, answer = await sim.post("/v1/completions", decode)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 40}
    assert sim.sleeper.waits == [0.009, 0.005]  # 3 blocks x 3 ms, one token gap


async def test_the_slow_fault_multiplies_every_latency(sim: InProcessSim) -> None:
    status, _ = await sim.post("/sim/faults", {"kind": "slow", "factor": 10})
    assert status == 201
    status, _ = await sim.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200
    assert sim.sleeper.waits == [0.8, 0.05]


async def test_stall_faults_wait_where_they_say(sim: InProcessSim) -> None:
    await sim.post("/sim/faults", {"kind": "stall_first_token", "delay_s": 7})
    await sim.post("/sim/faults", {"kind": "stall_mid_stream", "after_tokens": 2, "delay_s": 9})
    body = {"prompt": "a b", "max_tokens": 4, "stream": True}
    status, _ = await sim.post("/v1/completions", body)
    assert status == 200
    assert sim.sleeper.waits == [7.0, 0.004, 0.005, 9.0, 0.005, 0.005]


async def test_a_stall_after_zero_tokens_comes_before_the_first_event(sim: InProcessSim) -> None:
    await sim.post("/sim/faults", {"kind": "stall_mid_stream", "after_tokens": 0, "delay_s": 3})
    body = {"prompt": "a b", "max_tokens": 2, "stream": True}
    assert (await sim.post("/v1/completions", body))[0] == 200
    assert sim.sleeper.waits == [0.004, 3.0, 0.005]
