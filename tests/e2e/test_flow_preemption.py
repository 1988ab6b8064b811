"""Preemption end to end (`flow.preempt_priority`, docs/flow.md): real sims, a real router in
one process or with two workers, the official `openai` client. One decode slot, held by a
priority-2 stream; a priority-0 request arrives, the stream steps aside, the urgent request is
served, and the stream goes on from its last token: the client's text is exactly the
uninterrupted one, and nothing is charged to the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e.test_migration import MODEL, _assert_same, _stream
from tests.support.http import metric, metric_sum
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "40"]


async def _router(
    sim_factory: SimFactory, start_router: StartRouter, workers: int, **flow: Any
) -> RunningRouter:
    prefill, decode = sim_factory.start_many([P, D])
    engines = [
        {"id": "p0", "url": prefill.url, "role": "prefill", "max_concurrency": 4},
        {"id": "d0", "url": decode.url, "role": "decode", "max_concurrency": 1},
    ]
    rr = await start_router(engines, serving={"policy": "bounded", "workers": workers}, flow=flow)
    await rr.ready()
    return rr


async def _urgent(url: str, finished: list[str]) -> None:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
        answer = await client.completions.create(
            model=MODEL, prompt="urgent", max_tokens=4, extra_body={"priority": 0}
        )
    assert answer.choices[0].finish_reason == "length"
    finished.append("urgent")


@pytest.mark.parametrize("workers", [1, 2])
async def test_an_urgent_request_preempts_a_stream_which_goes_on_exactly(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    rr = await _router(sim_factory, start_router, workers, preempt_priority=0)
    low = {"priority": 2}
    reference = await _stream(rr.url, "completions", "a long low story", extra_body=low)
    finished: list[str] = []
    urgent: list[asyncio.Task[None]] = []

    async def then_urgent(n: int) -> None:
        if n == 5:  # the stream holds the one decode slot: the urgent request needs it
            urgent.append(asyncio.create_task(_urgent(rr.url, finished)))

    run = await _stream(rr.url, "completions", "a long low story", then_urgent, low)
    finished.append("low")
    await urgent[0]
    # With the one slot held to its end, the urgent request would finish after the stream.
    assert finished == ["urgent", "low"]
    _assert_same(run, reference)
    assert await metric(http, rr.url, "narwhal_preemptions_total", priority="2") == 1
    assert (
        await metric(http, rr.url, "narwhal_migrations_total", cause="preempted", kind="token_ids")
        == 1
    )
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    assert metric_sum(text, "narwhal_engine_failures_total", engine="d0") == 0
    await eventually(lambda: len(rr.router.flow.state) == 0, what="every grant given back")
    async with http.get(rr.url + "/admin/flow") as resp:
        doc = await resp.json()
    assert doc["preempted"] == {"2": 1}
    assert doc["resuming"] == 0 and doc["running"] == 0 and doc["waiting"] == 0


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_stream_asked_before_its_first_token_steps_aside_once_it_has_one(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    """The urgent request comes while the stream's decode is placed but its first token is
    stalled (1 s): asked then, the stream cannot step aside yet (no byte to go on from) and
    says so for now only; asked again once it has begun, it steps aside, and the urgent
    request finishes first."""
    prefill, decode = sim_factory.start_many([P, D])
    engines = [
        {"id": "p0", "url": prefill.url, "role": "prefill", "max_concurrency": 4},
        {"id": "d0", "url": decode.url, "role": "decode", "max_concurrency": 1},
    ]
    serving = {"policy": "bounded", "workers": workers}
    rr = await start_router(engines, serving=serving, flow={"preempt_priority": 0})
    await rr.ready()
    decode.add_fault({"kind": "stall_first_token", "delay_s": 1.0, "leg": "decode", "count": 1})
    finished: list[str] = []
    low = asyncio.create_task(
        _stream(rr.url, "completions", "a long low story", extra_body={"priority": 2})
    )
    await eventually(lambda: len(decode.requests()) == 1, what="the stream's decode stalled")
    urgent = asyncio.create_task(_urgent(rr.url, finished))
    await low
    finished.append("low")
    await urgent
    assert finished == ["urgent", "low"]
    assert await metric(http, rr.url, "narwhal_preemptions_total", priority="2") == 1


@pytest.mark.parametrize("workers", [1, 2])
async def test_without_preemption_the_urgent_request_waits_for_the_slot(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    rr = await _router(sim_factory, start_router, workers)
    finished: list[str] = []
    urgent: list[asyncio.Task[None]] = []

    async def then_urgent(n: int) -> None:
        if n == 5:
            urgent.append(asyncio.create_task(_urgent(rr.url, finished)))
            await eventually(lambda: rr.router.flow.state.waiting() == 1, what="urgent waiting")

    await _stream(rr.url, "completions", "a long low story", then_urgent, {"priority": 2})
    finished.append("low")
    await urgent[0]
    assert finished == ["low", "urgent"]
    assert await metric(http, rr.url, "narwhal_preemptions_total", priority="2") == 0
