"""The latency model, observed in-process through an injected sleeper (no real waiting)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from narwhal.clock import SystemClock
from narwhal.sim.config import SimConfig
from narwhal.sim.latency import Sleeper
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


@contextlib.asynccontextmanager
async def running(config: SimConfig, sleeper: Sleeper) -> AsyncIterator[str]:
    """A sim served in this process with `sleeper` for every wait; yields its URL."""
    server = SimServer(config, clock=SystemClock(), rng=random.Random(1), sleeper=sleeper)
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(ready.set_result, stop))
    try:
        yield await asyncio.wait_for(asyncio.shield(ready), 10)
    finally:
        stop.set()
        await task


@pytest.fixture
async def sim() -> AsyncIterator[InProcessSim]:
    sleeper = RecordingSleeper()
    config = SimConfig(ttft_per_token_ms=2.0, itl_ms=5.0, transfer_per_block_ms=3.0)
    async with running(config, sleeper) as url, aiohttp.ClientSession() as session:
        yield InProcessSim(url, sleeper, session)


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


@dataclass
class GatedSleeper:
    """Every wait holds until the test opens its gate; counts the waits under way at once."""

    started: asyncio.Queue[tuple[float, asyncio.Event]] = field(default_factory=asyncio.Queue)
    active: int = 0
    most: int = 0

    async def __call__(self, seconds: float) -> None:
        self.active += 1
        self.most = max(self.most, self.active)
        gate = asyncio.Event()
        await self.started.put((round(seconds, 9), gate))
        try:
            await gate.wait()
        finally:
            self.active -= 1


async def _two_prompts_at_once(serial: bool) -> GatedSleeper:
    """A 10-token prompt, then a 20-token one while the first computes (1 ms a token, no
    gaps between tokens: the prompts are the only waits); returns once both are answered."""
    sleeper = GatedSleeper()
    config = SimConfig(ttft_per_token_ms=1.0, itl_ms=0.0, serial_prefill=serial)
    async with running(config, sleeper) as url, aiohttp.ClientSession() as http:

        async def complete(words: int) -> int:
            body = {"prompt": " ".join(["w"] * words), "max_tokens": 1}
            async with http.post(url + "/v1/completions", json=body) as resp:
                return resp.status

        first = asyncio.create_task(complete(10))
        seconds, gate = await asyncio.wait_for(sleeper.started.get(), 10)
        assert seconds == 0.01
        second = asyncio.create_task(complete(20))

        async def both_running() -> None:
            while True:
                async with http.get(url + "/metrics") as resp:
                    page = await resp.read()
                series = b"vllm:num_requests_running{"
                line = next(x for x in page.splitlines() if x.startswith(series))
                if float(line.split()[-1]) == 2.0:
                    return

        # the second request holds a running slot before the first prompt is done
        await asyncio.wait_for(both_running(), 10)
        if serial:
            assert sleeper.started.empty(), "the second prompt computed beside the first"
            gate.set()
            seconds, second_gate = await asyncio.wait_for(sleeper.started.get(), 10)
        else:
            seconds, second_gate = await asyncio.wait_for(sleeper.started.get(), 10)
            gate.set()
        assert seconds == 0.02
        second_gate.set()
        assert await asyncio.wait_for(asyncio.gather(first, second), 10) == [200, 200]
    return sleeper


async def test_serial_prefill_computes_one_prompt_at_a_time_in_arrival_order() -> None:
    """`--serial-prefill`: a GPU's prefill throughput is shared, so the second prompt's
    time starts when the first's ends."""
    assert (await _two_prompts_at_once(serial=True)).most == 1


async def test_without_serial_prefill_each_prompt_runs_on_its_own_timer() -> None:
    assert (await _two_prompts_at_once(serial=False)).most == 2
