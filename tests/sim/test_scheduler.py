"""The engine's waiting queue: in-process (the scheduler alone, and a sim whose waits are
recorded, not slept), and over a real process (`--max-num-seqs` seen on /v1/loads)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from narwhal.clock import SystemClock
from narwhal.sim.config import SimConfig
from narwhal.sim.fleet import engine_args
from narwhal.sim.scheduler import Scheduler
from narwhal.sim.server import SimServer
from tests.support.poll import eventually
from tests.support.sim_process import SimFactory

from .helpers import complete


async def _holder(
    scheduler: Scheduler, name: str, log: list[str], gate: asyncio.Event, fits: Callable[[], bool]
) -> None:
    async with scheduler.slot(lambda: name if fits() else None, lambda _: None):
        log.append(name)
        await gate.wait()


async def test_requests_beyond_the_batch_limit_wait_in_arrival_order() -> None:
    scheduler = Scheduler(max_num_seqs=1)
    log: list[str] = []
    gates = {n: asyncio.Event() for n in "abc"}
    tasks = {
        n: asyncio.create_task(_holder(scheduler, n, log, gates[n], lambda: True)) for n in "abc"
    }
    await asyncio.sleep(0)
    assert (log, scheduler.running, scheduler.waiting) == (["a"], 1, 2)
    tasks["b"].cancel()  # a waiter that leaves gives its turn up
    await asyncio.gather(tasks["b"], return_exceptions=True)
    assert scheduler.waiting == 1
    gates["a"].set()
    await tasks["a"]
    await asyncio.sleep(0)
    assert (log, scheduler.running, scheduler.waiting) == (["a", "c"], 1, 0)
    gates["c"].set()
    await tasks["c"]
    assert scheduler.running == 0


async def test_a_request_whose_blocks_do_not_fit_waits_and_none_overtakes_it() -> None:
    scheduler = Scheduler(max_num_seqs=None)
    room = {"free": False}
    log: list[str] = []
    gate, running_gate = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(_holder(scheduler, "r", log, running_gate, lambda: True))
    await asyncio.sleep(0)
    first = asyncio.create_task(_holder(scheduler, "big", log, gate, lambda: room["free"]))
    second = asyncio.create_task(_holder(scheduler, "small", log, gate, lambda: True))
    await asyncio.sleep(0)
    assert (log, scheduler.running, scheduler.waiting) == (["r"], 1, 2)
    room["free"] = True
    running_gate.set()  # its release admits the waiters, in order
    await running
    await asyncio.sleep(0)
    assert log == ["r", "big", "small"]
    gate.set()
    await asyncio.gather(first, second)


@dataclass
class RecordingSleeper:
    waits: list[float] = field(default_factory=list)

    async def __call__(self, seconds: float) -> None:
        self.waits.append(round(seconds, 9))
        await asyncio.sleep(0)


@pytest.fixture
async def cached_sim() -> AsyncIterator[tuple[str, RecordingSleeper]]:
    sleeper = RecordingSleeper()
    config = SimConfig(ttft_per_token_ms=2.0, itl_ms=0.0, kv_blocks=32, max_model_len=512)
    server = SimServer(config, clock=SystemClock(), rng=random.Random(1), sleeper=sleeper)
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(ready.set_result, stop))
    try:
        yield await asyncio.wait_for(asyncio.shield(ready), 10), sleeper
    finally:
        stop.set()
        await task


async def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        answer: dict[str, Any] = await resp.json()
        return answer


async def test_a_repeated_prompt_pays_only_for_its_uncached_tokens(
    cached_sim: tuple[str, RecordingSleeper],
) -> None:
    url, sleeper = cached_sim
    prompt = " ".join(f"w{i}" for i in range(40))  # 2 full blocks of 16, 8 more tokens
    first = await _complete(url, {"prompt": prompt, "max_tokens": 1})
    second = await _complete(url, {"prompt": prompt, "max_tokens": 1})
    assert sleeper.waits == [0.08, 0.016]  # 40 x 2 ms, then 8 x 2 ms
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    salted = await _complete(url, {"prompt": prompt, "max_tokens": 1, "cache_salt": "t1"})
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # salt: own blocks


async def test_beyond_max_num_seqs_a_request_waits_and_loads_show_it(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--itl-ms", "0", "--max-num-seqs", "1")
    sim.add_fault({"kind": "stall_mid_stream", "after_tokens": 1, "count": 1, "delay_s": 60})
    body = {"prompt": "a b c", "max_tokens": 3}
    async with aiohttp.ClientSession() as session:

        async def stream() -> None:
            async with session.post(sim.url + "/v1/completions", json=body | {"stream": True}):
                await asyncio.Event().wait()

        held = asyncio.create_task(stream())
        await eventually(lambda: sim.get_json("/v1/loads")["running"] == 1, what="one running")
        waiter = asyncio.create_task(asyncio.to_thread(complete, sim, body))
        loads = await eventually(
            lambda: (d := sim.get_json("/v1/loads"))["waiting"] == 1 and d, what="one waiting"
        )
        assert loads == {"running": 1, "waiting": 1, "num_reqs": 1, "num_waiting_reqs": 1}
        assert sim.metric("vllm:num_requests_waiting") == 1
        held.cancel()  # the running client leaves: the waiting request runs
        await asyncio.gather(held, return_exceptions=True)
        assert (await waiter)["choices"][0]["finish_reason"] == "length"
    assert sim.get_json("/v1/loads")["waiting"] == 0


def test_a_fleet_gives_each_engine_its_own_event_ports() -> None:
    extra = ["--kv-blocks", "64", "--kv-events-port", "7000", "--kv-events-replay-port=7500"]
    assert engine_args(101, extra) == [
        "--kv-blocks",
        "64",
        "--kv-events-port",
        "7101",
        "--kv-events-replay-port=7601",
    ]
    assert engine_args(3, ["--kv-events-port", "0"]) == ["--kv-events-port", "0"]
