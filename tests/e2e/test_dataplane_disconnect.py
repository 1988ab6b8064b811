"""A client that hangs up mid-request: the upstream legs are aborted, nothing is recorded
against any engine, and the request's in-flight count and data connection are given back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"
C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[SimProcess, SimProcess]]:
    """A prefill sim and a slow decode sim (50 ms per token) for the whole module."""
    factory = SimFactory()
    try:
        prefill, decode = factory.start_many(
            [["--role", "prefill", "--kv-role", "kv_producer"],
             ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "50"]]
        )  # fmt: skip
        yield prefill, decode
    finally:
        factory.close()


async def _running(sim: SimProcess) -> float:
    return await asyncio.to_thread(sim.metric, "vllm:num_requests_running")


def _running_is(sim: SimProcess, count: int) -> Any:
    """A probe for `eventually`: the sim has `count` completions in flight."""

    async def probe() -> bool:
        return await _running(sim) == count

    return probe


class Sims:
    def __init__(self, prefill: SimProcess, decode: SimProcess) -> None:
        self.prefill = prefill
        self.decode = decode


@pytest.fixture
async def sims(shared: tuple[SimProcess, SimProcess]) -> Sims:
    for sim in shared:
        sim.clear_faults()
        await eventually(_running_is(sim, 0), timeout_s=5, what="sim idle")
        sim.clear_requests()
    return Sims(*shared)


@pytest.fixture
async def rr(sims: Sims, start_router: StartRouter) -> RunningRouter:
    return await start_router(
        [{"id": "p0", "url": sims.prefill.url, "role": "prefill"},
         {"id": "d0", "url": sims.decode.url, "role": "decode"}],
        recovery={"eject_after": 100},
        # The subject is the legs: a health check a loaded host answers late (past the
        # tests' 0.5 s) is a timeout rightly counted, and no business of these tests.
        engine={"health_timeout_s": 3.0},
    )  # fmt: skip


async def _samples(http: aiohttp.ClientSession, rr: RunningRouter) -> list[Any]:
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


async def _assert_nothing_recorded(http: aiohttp.ClientSession, rr: RunningRouter) -> None:
    await eventually(
        lambda: all(e["in_flight"] == 0 for e in rr.router.engines_json()),
        timeout_s=5,
        what="in_flight back to 0",
    )
    # Given back when the handler returns, just after the engines' slots (with workers, a
    # later write to the shared table).
    await eventually(
        lambda: rr.router.data_pool_usage()[0] == 0, timeout_s=5, what="data connection back"
    )
    for engine in rr.router.engines_json():
        assert all(v == 0 for v in engine["evidence"].values()), engine
        assert engine["ejected"] is False and engine["holds"] == []
    samples = await _samples(http, rr)
    failures = [s for s in samples if s.name == "narwhal_engine_failures_total" and s.value]
    assert failures == [], failures
    outcomes = {s.labels["outcome"] for s in samples if s.name == "narwhal_requests_total"}
    assert outcomes == {"client_disconnect"}


@pytest.mark.parametrize("path", [C, CHAT])
async def test_client_disconnect_mid_stream_aborts_the_decode_leg(
    rr: RunningRouter, sims: Sims, http: aiohttp.ClientSession, path: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "stream": True}  # 10 s of tokens
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "talk for a while"}]
    else:
        body["prompt"] = "talk for a while"
    resp = await http.post(rr.url + path, json=body)
    assert resp.status == 200
    received = b""
    while received.count(b'data: {"id"') < 3:
        received += await resp.content.readany()
    assert await _running(sims.decode) == 1
    resp.close()  # hang up mid-stream

    await eventually(_running_is(sims.decode, 0), timeout_s=5, what="decode aborted")
    await _assert_nothing_recorded(http, rr)
    assert len(sims.decode.requests()) == 1


async def test_client_disconnect_during_prefill_aborts_it_and_skips_decode(
    rr: RunningRouter, sims: Sims, http: aiohttp.ClientSession
) -> None:
    sims.prefill.add_fault({"kind": "stall_first_token", "leg": "prefill", "delay_s": 30})
    body = {"model": MODEL, "prompt": "slow prefill", "max_tokens": 4, "stream": True}
    task = asyncio.create_task(http.post(rr.url + C, json=body))
    await eventually(_running_is(sims.prefill, 1), timeout_s=5, what="prefill running")
    task.cancel()  # the client gives up before any byte came back
    with pytest.raises(asyncio.CancelledError):
        await task

    await eventually(_running_is(sims.prefill, 0), timeout_s=5, what="prefill aborted")
    await _assert_nothing_recorded(http, rr)
    assert sims.decode.requests() == []
