"""Cache-aware placement (`placement.policy: prefix`, DESIGN §11) in front of simulated engines
that keep a prefix cache and publish vLLM's KV events over real ZMQ sockets, with a real
tokenizer in the router and in the engines, through the official `openai` client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.http import metric, metric_sum
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimProcess
from tests.support.tokenizers import wheel_tokenizer

MODEL = "demo-model"
PREFIX = "You are a careful assistant who answers questions about the sea. " * 12


@pytest.fixture(scope="module")
def tokenizer() -> Path:
    return wheel_tokenizer("qwen3")


def _sims(tokenizer: Path, *extra: str) -> Iterator[list[SimProcess]]:
    common = ("--kv-blocks", "2048", "--block-size", "16", "--tokenizer", str(tokenizer), *extra)
    events = ("--kv-events-port", "0", "--kv-events-replay-port", "0")
    procs = [
        SimProcess("--role", "prefill", "--kv-role", "kv_producer", *common, *events),
        SimProcess("--role", "prefill", "--kv-role", "kv_producer", *common, *events),
        SimProcess("--role", "decode", "--kv-role", "kv_consumer", *common),
    ]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.close()


@pytest.fixture
def sims(tokenizer: Path) -> Iterator[list[SimProcess]]:
    """p0, p1 (prefill) and d0 (decode), each with a prefix cache and KV events."""
    yield from _sims(tokenizer)


ADAPTER = "sea-lora"


@pytest.fixture
def lora_sims(tokenizer: Path) -> Iterator[list[SimProcess]]:
    """`sims`, each also serving the LoRA adapter `ADAPTER` (vLLM's `--lora-modules`)."""
    yield from _sims(tokenizer, "--lora", ADAPTER)


def _engines(sims: list[SimProcess], ids: tuple[str, ...] = ("p0", "p1", "d0")) -> list[dict]:
    by_id = dict(zip(("p0", "p1", "d0"), sims, strict=True))
    engines: list[dict[str, Any]] = []
    for engine_id in ids:
        sim = by_id[engine_id]
        entry: dict[str, Any] = {"id": engine_id, "url": sim.url}
        if engine_id.startswith("p"):
            events = sim.get_json("/sim/kv_events")
            entry |= {"role": "prefill", "kv_role": "kv_producer"}
            entry["kv_events"] = {k: events[k] for k in ("endpoint", "replay_endpoint", "topic")}
        else:
            entry |= {"role": "decode", "kv_role": "kv_consumer"}
        engines.append(entry)
    return engines


async def _complete(rr: RunningRouter, prompt: str, model: str = MODEL) -> Any:
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0) as client:
        return await client.completions.create(model=model, prompt=prompt, max_tokens=4)


async def _index_blocks(rr: RunningRouter, engine: str) -> float:
    async with aiohttp.ClientSession() as http:
        return await metric(http, rr.url, "narwhal_prefix_index_blocks", engine=engine)


@pytest.mark.single_process  # the router's own index is the one it places with
async def test_a_prefix_stored_on_an_engine_draws_its_requests_there_by_its_events(
    start_router: StartRouter, sims: list[SimProcess], tokenizer: Path
) -> None:
    """Router `a` (only p1 as prefill) runs a prompt, so p1 caches its prefix and publishes
    the blocks. Router `b` never placed that prefix itself: it knows where it is only from p1's
    events, and sends the next prompt with that prefix to p1, not to p0 (first in rotation),
    where the engine's own answer shows the prefix came from its cache."""
    placement = {"policy": "prefix", "tokenizers": {MODEL: str(tokenizer)}}
    b = await start_router(_engines(sims), placement=placement)
    a = await start_router(_engines(sims, ("p1", "d0")), placement=placement)
    first = await _complete(a, PREFIX + "How deep is the sea?")
    assert first.usage.prompt_tokens > 100
    assert len(sims[1].requests()) == 1

    async def learned() -> bool:
        return await _index_blocks(b, "p1") >= first.usage.prompt_tokens // 16 - 1

    await eventually(learned, timeout_s=10, what="router b learned p1's blocks from its events")
    assert await _index_blocks(b, "p0") == 0

    second = await _complete(b, PREFIX + "What lives at the bottom?")
    assert len(sims[1].requests()) == 2, "placed on the engine holding the prefix"
    assert sims[0].requests() == []
    # The prefill engine's own counter (a decode's `cached_tokens` counts what it loaded).
    hits = metric_sum(sims[1].metrics(), "vllm:prefix_cache_hits_total")
    assert hits >= 100, f"p1 computed the prompt's shared prefix from its cache ({hits} tokens)"
    assert second.usage.prompt_tokens > 100
    async with aiohttp.ClientSession() as http:
        hit = await metric(http, b.url, "narwhal_prefix_hit_tokens_total", model=MODEL)
        looked = await metric(http, b.url, "narwhal_prefix_lookup_tokens_total", model=MODEL)
        p1_hit = await metric(http, b.url, "narwhal_prefix_engine_hit_tokens_total", engine="p1")
        async with http.get(b.url + "/admin/engines") as resp:
            shown = (await resp.json())["placement"]
    assert 0 < hit <= looked
    # What `narwhal status` and the dashboard show: the same counts, and p1's blocks.
    assert shown["policy"] == "prefix"
    assert shown["models"][MODEL] == {
        "lookup_tokens": looked,
        "hit_tokens": hit,
        "hit_rate": hit / looked,
    }
    assert shown["cached_blocks"]["p1"] > 0 and shown["cached_blocks"]["p0"] == 0
    # Per prefill engine chosen: every placement went to p1, so its counts are the model's.
    assert p1_hit == hit
    assert shown["engines"]["p1"] == shown["models"][MODEL]
    assert "p0" not in shown["engines"]


@pytest.mark.single_process  # the router's own index is the one it places with
async def test_a_lora_adapters_prefix_is_found_under_its_own_name(
    start_router: StartRouter, lora_sims: list[SimProcess], tokenizer: Path
) -> None:
    """vLLM keys an adapter's blocks by the adapter's name (`BlockStored.lora_name`). Router
    `b` learns from p1's events where the adapter's prefix is and sends the adapter's next
    request there, keyed with the adapter's name on the base model's index and tokenizer
    (no `placement.tokenizers` entry of its own); the same text for the base model matches
    nothing: the adapter's cache is not the model's."""
    sims = lora_sims
    placement = {"policy": "prefix", "tokenizers": {MODEL: str(tokenizer)}}
    b = await start_router(_engines(sims), placement=placement)
    a = await start_router(_engines(sims, ("p1", "d0")), placement=placement)
    first = await _complete(a, PREFIX + "How deep is the sea?", model=ADAPTER)
    assert first.model == ADAPTER and first.usage.prompt_tokens > 100

    async def learned() -> bool:
        return await _index_blocks(b, "p1") >= first.usage.prompt_tokens // 16 - 1

    await eventually(learned, timeout_s=10, what="router b learned p1's blocks from its events")

    async def explain(model: str) -> dict[str, Any]:
        body = {"model": model, "prompt": PREFIX + "Why is it salty?", "max_tokens": 4}
        async with (
            aiohttp.ClientSession() as http,
            http.post(b.url + "/admin/placement", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            view: dict[str, Any] = await r.json()
            return view

    async def adapter_matched() -> dict[str, Any] | None:
        # The fleet's adapters reach placement at its next sync (every metrics interval).
        view = await explain(ADAPTER)
        return view if view["prefill"][0]["matched_tokens"] > 0 else None

    adapter_view = await eventually(adapter_matched, timeout_s=10, what="the adapter matched")
    assert adapter_view["prefill"][0]["id"] == "p1"
    assert adapter_view["prefill"][0]["matched_tokens"] >= 100
    base_view = await explain(MODEL)
    assert all(e["matched_tokens"] == 0 for e in base_view["prefill"]), base_view

    await _complete(b, PREFIX + "What lives at the bottom?", model=ADAPTER)
    assert len(sims[1].requests()) == 2, "placed on the engine holding the adapter's prefix"
    assert sims[0].requests() == []
    hits = metric_sum(sims[1].metrics(), "vllm:prefix_cache_hits_total")
    assert hits >= 100, f"p1 computed the adapter's prefix from its cache ({hits} tokens)"


async def test_a_dropped_event_message_is_a_gap_the_replay_fills(
    start_router: StartRouter, sims: list[SimProcess], tokenizer: Path
) -> None:
    """p1 loses one live message (its number spent, kept in its replay buffer): the router
    counts the gap and the replay, and holds the lost message's blocks all the same."""
    placement = {"policy": "prefix", "tokenizers": {MODEL: str(tokenizer)}}
    rr = await start_router(_engines(sims, ("p1", "d0")), placement=placement)
    answers = [await _complete(rr, "A first prompt, published whole. " * 4)]
    sims[1].add_fault({"kind": "kv_events_drop", "count": 1})
    answers.append(await _complete(rr, PREFIX + "How deep is the sea?"))  # never sent live
    answers.append(await _complete(rr, "A third prompt, whose message shows the gap. " * 4))

    async def counted() -> bool:
        async with aiohttp.ClientSession() as http:
            gaps = await metric(http, rr.url, "narwhal_kv_event_gaps_total", engine="p1")
            replays = await metric(http, rr.url, "narwhal_kv_event_replays_total", engine="p1")
        return gaps == 1 and replays >= 1

    await eventually(counted, timeout_s=10, what="the gap and its replay counted")
    assert sims[1].get_json("/sim/kv_events")["dropped"] == 1
    # Every prompt's full blocks applied from events, the lost message's by the replay.
    blocks = sum(a.usage.prompt_tokens // 16 for a in answers)

    async def applied() -> bool:
        async with aiohttp.ClientSession() as http:
            got = await metric(http, rr.url, "narwhal_kv_event_blocks_total", engine="p1")
        return got >= blocks

    await eventually(applied, timeout_s=10, what="the lost message's blocks, replayed")


async def test_without_prefix_placement_the_same_prompts_rotate(
    start_router: StartRouter, sims: list[SimProcess], tokenizer: Path
) -> None:
    """The control: `least_loaded` (the default) spreads the same two prompts over both."""
    rr = await start_router(_engines(sims))
    await _complete(rr, PREFIX + "How deep is the sea?")
    await _complete(rr, PREFIX + "What lives at the bottom?")
    assert (len(sims[0].requests()), len(sims[1].requests())) == (1, 1)


async def test_an_engine_that_clears_its_cache_holds_nothing_in_the_index(
    start_router: StartRouter, sims: list[SimProcess], tokenizer: Path
) -> None:
    """`AllBlocksCleared` (vLLM's reset_prefix_cache) empties the engine's exact entries."""
    placement = {"policy": "prefix", "tokenizers": {MODEL: str(tokenizer)}}
    rr = await start_router(_engines(sims, ("p1", "d0")), placement=placement)
    answer = await _complete(rr, PREFIX + "How deep is the sea?")
    stored = answer.usage.prompt_tokens // 16  # the prompt's full blocks

    async def learned() -> float:
        async with aiohttp.ClientSession() as http:
            events = await metric(http, rr.url, "narwhal_kv_events_total", engine="p1")
        return events and await _index_blocks(rr, "p1")

    before = await eventually(learned, timeout_s=10, what="p1's blocks in the index")
    assert before >= stored
    async with aiohttp.ClientSession() as http:
        ingested = await metric(http, rr.url, "narwhal_kv_event_blocks_total", engine="p1")
        memory = await metric(http, rr.url, "narwhal_prefix_index_bytes")
    assert ingested >= stored
    assert memory >= before * 300  # an estimate: 315 to 380 bytes an entry
    status, _ = sims[1].http("POST", "/reset_prefix_cache")
    assert status == 200

    async def dropped() -> bool:  # what Narwhal's own placement left may remain
        return await _index_blocks(rr, "p1") <= before - stored

    await eventually(dropped, timeout_s=10, what="p1's exact entries dropped")


async def test_admin_placement_explains_a_decision_without_running_it(
    start_router: StartRouter, sims: list[SimProcess], tokenizer: Path
) -> None:
    """`POST /admin/placement` ranks each role's engines for a body, best first, with the
    matched tokens and scores, and sends nothing to any engine."""
    placement = {"policy": "prefix", "tokenizers": {MODEL: str(tokenizer)}}
    rr = await start_router(_engines(sims), placement=placement)
    first = await _complete(rr, PREFIX + "How deep is the sea?")
    holder = "p0" if sims[0].requests() else "p1"
    sent = [len(s.requests()) for s in sims]

    async def explained() -> dict[str, Any] | None:
        body = {"model": MODEL, "prompt": PREFIX + "Why is it salty?", "max_tokens": 4}
        async with (
            aiohttp.ClientSession() as http,
            http.post(rr.url + "/admin/placement", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            view = await r.json()
        return view if view["prefill"][0]["matched_tokens"] > 0 else None

    view = await eventually(explained, timeout_s=10, what="the control process's index")
    assert view["model"] == MODEL
    assert view["prompt_tokens"] > first.usage.prompt_tokens // 2
    assert view["prefill"][0]["id"] == holder
    assert {e["id"] for e in view["prefill"]} == {"p0", "p1"}
    assert [e["id"] for e in view["decode"]] == ["d0"]
    assert view["chosen"] == {"prefill": holder, "decode": "d0"}
    assert [len(s.requests()) for s in sims] == sent, "nothing ran"
    async with aiohttp.ClientSession() as http:
        async with http.post(rr.url + "/admin/placement", data=b"{") as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"]
        async with http.post(
            rr.url + "/admin/placement", json={"model": "nope", "prompt": "x"}
        ) as r:
            assert r.status == 404


async def test_every_worker_follows_a_placement_made_by_another(
    start_router: StartRouter, sims: list[SimProcess]
) -> None:
    """With data-plane workers, a new prefix placed by one worker is speculative in every
    other worker at once: requests with that prefix, each on a new connection (so spread over
    the workers by the kernel), all go to the first one's prefill engine, not in rotation."""
    rr = await start_router(_engines(sims), placement={"policy": "prefix"}, serving={"workers": 2})
    for question in ("one", "two", "three", "four", "five", "six"):
        async with aiohttp.ClientSession() as http:  # a new connection each time
            body = {"model": MODEL, "prompt": PREFIX + question, "max_tokens": 2}
            async with http.post(rr.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
    served = sorted(len(s.requests()) for s in sims[:2])
    assert served == [0, 6], f"the prefix stayed on one prefill engine ({served})"
    async with aiohttp.ClientSession() as http, http.get(rr.url + "/admin/workers") as r:
        workers = (await r.json())["workers"]
    assert len(workers) == 2


@pytest.mark.single_process  # reads the router's own scraped loads
async def test_an_engine_with_a_queue_of_its_own_is_passed_over(
    start_router: StartRouter, tokenizer: Path
) -> None:
    """The engines' `/metrics` are scraped for placement: p0, whose queue others fill
    (`vllm:num_requests_running` and `..._waiting`), loses the request that rotation would
    have given it."""
    p0 = SimProcess("--role", "prefill", "--kv-role", "kv_producer", "--max-num-seqs", "1",
                    "--itl-ms", "50")  # fmt: skip
    p1 = SimProcess("--role", "prefill", "--kv-role", "kv_producer")
    d0 = SimProcess("--role", "decode", "--kv-role", "kv_consumer")
    with p0, p1, d0:
        engines = [
            {"id": "p0", "url": p0.url, "role": "prefill", "kv_role": "kv_producer"},
            {"id": "p1", "url": p1.url, "role": "prefill", "kv_role": "kv_producer"},
            {"id": "d0", "url": d0.url, "role": "decode", "kv_role": "kv_consumer"},
        ]
        rr = await start_router(
            engines, placement={"policy": "prefix", "metrics_interval_s": 0.1,
                                "metrics_stale_s": 2.0},
        )  # fmt: skip
        prefix = rr.router.dataplane.prefix
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "another client's long job", "max_tokens": 200}
            others = [
                asyncio.create_task(http.post(p0.url + "/v1/completions", json=body))
                for _ in range(3)
            ]
            try:
                await eventually(
                    lambda: (load := prefix.loads.get("p0")) is not None and load.waiting >= 1,
                    timeout_s=10, what="p0's own queue scraped",
                )  # fmt: skip
                answer = await _complete(rr, "a question nobody asked before")
                assert answer.choices
                assert len(p1.requests()) == 1, "placed on the engine without a queue"
                async with http.post(
                    rr.url + "/admin/placement", json={"model": MODEL, "prompt": "x"}
                ) as r:
                    view = await r.json()
                assert view["chosen"]["prefill"] == "p1"
            finally:
                for task in others:
                    task.cancel()
