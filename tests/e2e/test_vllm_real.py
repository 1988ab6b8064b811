"""The vllm adapter end to end, against real vLLM processes on the CPU (issue 28).

Two vLLM servers (the CPU build, Gemma 3 270M) run the NixlConnector with a CPU KV buffer: the
prefill one keeps a prompt's KV for the decode one, which pulls it over NIXL. Checked through
Narwhal with the official `openai` client: `/v1/models`, `/tokenize`, completions and chat
(streamed and not) equal to a unified run at temperature 0, with the decode engine's own
metrics showing that it computed no prompt token and read them all from the prefill engine;
`return_token_ids` (what migration reads); the `/metrics` names Narwhal and the sim share with
vLLM; and the KV events' wire format (docs/engines.md, "KV events on the wire") read with
pyzmq: PUB frames, msgpack batches, BlockStored / BlockRemoved / AllBlocksCleared, the replay
socket; and those events feeding `placement.policy: prefix` with both servers as unified
engines (a prompt goes to the engine that holds its prefix, read from vLLM's own counters).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from narwhal.engine.vllm import parse_generation
from tests.support.http import metric_sum
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.vllm import MODEL_ALIAS, VllmInstall, VllmServer, prime_handoff, vllm

__all__ = ["vllm"]  # the session fixture, used by this module's fixtures

pytestmark = pytest.mark.vllm

# One router process: two vLLM servers already share the 2 cores, and a router's worker
# processes starting beside them are what the 10 s start-up bound of `start_router` met.
SECTIONS: dict[str, Any] = {
    "serving": {
        "workers": 1,
        "request_timeout_s": 120,
        "first_token_timeout_s": 60,
        "stream_idle_timeout_s": 60,
    },
    "engine": {"health_timeout_s": 5.0, "probe_timeout_s": 60.0},
    "controller": {"monitor_interval_s": 0.5},
}
PROMPT = "Once upon a time in a land far away there lived a king who had three daughters. The"
# The prefill engine's KV cache: small, so a few prompts evict blocks (BlockRemoved).
PREFILL_KV_BYTES = 48 << 20  # 256 blocks of 32 tokens in float32
BLOCK_STORED_KEYS = {
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
}  # fmt: skip


@pytest.fixture(scope="module")
def servers(vllm: VllmInstall, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """A prefill and a decode vLLM, started together (each takes about a minute here)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    prefill = VllmServer(
        vllm, logs / "prefill.log", kv_role="kv_producer", kv_cache_bytes=PREFILL_KV_BYTES
    )
    decode = VllmServer(vllm, logs / "decode.log", kv_role="kv_consumer")
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        prime_handoff(prefill, decode)
        yield Servers(prefill, decode)
    finally:
        prefill.stop()
        decode.stop()


class Servers:
    def __init__(self, prefill: VllmServer, decode: VllmServer) -> None:
        self.prefill = prefill
        self.decode = decode


def unique(text: str) -> str:
    """A prompt no engine has cached yet."""
    return f"[{uuid.uuid4().hex[:8]}] {text}"


async def pd_router(start_router: StartRouter, servers: Servers) -> RunningRouter:
    rr = await start_router(
        [
            {"id": "p1", "url": servers.prefill.url, "role": "prefill"},
            {"id": "d1", "url": servers.decode.url, "role": "decode"},
        ],
        **SECTIONS,
    )
    await eventually(lambda: rr.router.ready() is None, timeout_s=30, what="router ready")
    return rr


async def unified_router(start_router: StartRouter, server: VllmServer) -> RunningRouter:
    rr = await start_router([{"id": "u1", "url": server.url, "role": "both"}], **SECTIONS)
    await eventually(lambda: rr.router.ready() is None, timeout_s=30, what="router ready")
    return rr


async def text_of(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def tokenize(http: aiohttp.ClientSession, url: str, prompt: str) -> list[int]:
    async with http.post(url + "/tokenize", json={"model": MODEL_ALIAS, "prompt": prompt}) as r:
        assert r.status == 200, await r.text()
        tokens: list[int] = (await r.json())["tokens"]
        return tokens


def by_source(metrics: str, source: str) -> float:
    return metric_sum(metrics, "vllm:prompt_tokens_by_source_total", source=source)


async def test_models_tokenize_and_metrics_through_narwhal(
    start_router: StartRouter, servers: Servers, http: aiohttp.ClientSession
) -> None:
    rr = await pd_router(start_router, servers)
    client = openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="unused", max_retries=0)

    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL_ALIAS]

    # /tokenize passes through to an engine: the same ids as the engine's, <bos> (2) first.
    async with http.post(rr.url + "/tokenize", json={"model": MODEL_ALIAS, "prompt": PROMPT}) as r:
        assert r.status == 200, await r.text()
        through = await r.json()
    direct = await tokenize(http, servers.prefill.url, PROMPT)
    assert through["tokens"] == direct and direct[0] == 2
    assert through["count"] == len(direct) and through["max_model_len"] == 1024

    # What Narwhal reads from a vLLM engine's /metrics, and what the sim imitates.
    for server in (servers.prefill, servers.decode):
        text = await text_of(http, server.url)
        generation = parse_generation(text.encode())
        assert generation is not None and 0 < time.time() - generation < 3600
        names = {s.name: s.labels for f in text_string_to_metric_families(text) for s in f.samples}
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
        ):
            assert names[name]["model_name"] == MODEL_ALIAS, name
        # The cache's shape, labelled by engine index only (no model_name).
        assert names["vllm:cache_config_info"]["enable_prefix_caching"] == "True"

    # The limit Narwhal learned from /v1/models (--max-model-len 1024) turns an over-long
    # prompt away with a 400 before any engine sees it.
    queued = metric_sum(await text_of(http, servers.prefill.url), "vllm:prompt_tokens_total")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        await client.completions.create(model=MODEL_ALIAS, prompt=PROMPT * 60, max_tokens=4)
    after = metric_sum(await text_of(http, servers.prefill.url), "vllm:prompt_tokens_total")
    assert after == queued

    # The router took each engine's generation from process_start_time_seconds.
    for engine_id, server in (("p1", servers.prefill), ("d1", servers.decode)):
        expected = parse_generation((await text_of(http, server.url)).encode())
        state = next(e for e in rr.router.engines_json() if e["id"] == engine_id)
        assert state["generation"] == expected


async def test_pd_over_nixl_through_narwhal_equals_unified(
    start_router: StartRouter, servers: Servers, http: aiohttp.ClientSession
) -> None:
    pd = await pd_router(start_router, servers)
    unified = await unified_router(start_router, servers.prefill)
    client = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0)
    direct = openai.AsyncOpenAI(base_url=unified.url + "/v1", api_key="unused", max_retries=0)
    # Fixed prompts, new to both engines (no other test sends them): the comparison is the
    # same arithmetic on every run, not a fresh near-tie each time.
    prompt = "[pd] " + PROMPT
    before = await text_of(http, servers.decode.url)

    split = await client.completions.create(
        model=MODEL_ALIAS, prompt=prompt, max_tokens=16, temperature=0
    )
    after = await text_of(http, servers.decode.url)
    whole = await direct.completions.create(
        model=MODEL_ALIAS, prompt=prompt, max_tokens=16, temperature=0
    )
    assert split.choices[0].text == whole.choices[0].text
    assert split.choices[0].text.strip()
    assert split.usage is not None and split.usage.completion_tokens == 16
    prompt_tokens = split.usage.prompt_tokens
    # The decode engine read every prompt token from the prefill engine over NIXL and
    # computed none itself.
    moved = by_source(after, "external_kv_transfer") - by_source(before, "external_kv_transfer")
    assert moved == prompt_tokens
    assert by_source(after, "local_compute") == by_source(before, "local_compute")
    assert metric_sum(after, "vllm:nixl_xfer_time_seconds_count") > metric_sum(
        before, "vllm:nixl_xfer_time_seconds_count"
    )

    # Streamed chat through the split, against the unified engine.
    messages: Any = [{"role": "user", "content": "[pd] Name three colours."}]
    stream = await client.chat.completions.create(
        model=MODEL_ALIAS, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    whole_chat = await direct.chat.completions.create(
        model=MODEL_ALIAS, messages=messages, max_tokens=12, temperature=0
    )
    assert "".join(pieces) == whole_chat.choices[0].message.content
    assert "".join(pieces).strip()
    after_chat = await text_of(http, servers.decode.url)
    assert by_source(after_chat, "local_compute") == by_source(before, "local_compute")

    # No leg failed and no handoff was refused.
    router_metrics = await text_of(http, pd.url)
    assert metric_sum(router_metrics, "narwhal_leg_outcomes_total", outcome="kv_handoff") == 0
    assert metric_sum(router_metrics, "narwhal_leg_outcomes_total", leg="decode") >= 2


async def test_return_token_ids_through_narwhal(
    start_router: StartRouter, servers: Servers, http: aiohttp.ClientSession
) -> None:
    """What migration reads: the prompt's ids in the first chunk, each chunk's `token_ids`."""
    rr = await pd_router(start_router, servers)
    client = openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="unused", max_retries=0)
    prompt = unique(PROMPT)
    stream = await client.completions.create(
        model=MODEL_ALIAS,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = [c.model_dump() async for c in stream]
    first = chunks[0]["choices"][0]
    assert first["prompt_token_ids"] == await tokenize(http, servers.prefill.url, prompt)
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert len(ids) == 10
    async with http.post(
        servers.decode.url + "/detokenize", json={"model": MODEL_ALIAS, "tokens": ids}
    ) as r:
        assert (await r.json())["prompt"] == text

    # A chat stream gives the rendered prompt's ids in its first chunk (no `/apply-template`).
    messages: Any = [{"role": "user", "content": "Hello"}]
    chat = await client.chat.completions.create(
        model=MODEL_ALIAS,
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chat_chunks = [c.model_dump() async for c in chat]
    # <bos> <start_of_turn> user \n Hello <end_of_turn> \n <start_of_turn> model \n
    assert chat_chunks[0]["prompt_token_ids"][:4] == [2, 105, 2364, 107]
    assert chat_chunks[0]["prompt_token_ids"][-3:] == [105, 4368, 107]
    assert sum(len(ch.get("token_ids") or []) for c in chat_chunks for ch in c["choices"]) >= 1

    # Without the flag the client sees no ids (Narwhal adds and removes them for migration).
    plain = await client.completions.create(
        model=MODEL_ALIAS, prompt=prompt, max_tokens=3, temperature=0, stream=True
    )
    plain_chunks = [c.model_dump() async for c in plain]
    assert plain_chunks and not any(c.get("prompt_token_ids") for c in plain_chunks)
    assert not any(
        ch.get("token_ids") or ch.get("prompt_token_ids")
        for c in plain_chunks
        for ch in c["choices"]
    )


class Subscriber:
    """A SUB socket on one engine's KV-event PUB, keeping the raw frames it receives."""

    def __init__(self, ctx: zmq.asyncio.Context, url: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.connect(url)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.frames: list[list[bytes]] = []

    async def drain(self) -> None:
        while await self.sock.poll(0):
            self.frames.append(await self.sock.recv_multipart())

    async def events(self) -> list[dict[str, Any]]:
        await self.drain()
        return [e for f in self.frames for e in msgspec.msgpack.decode(f[2])[1]]

    async def wait_for(self, pred: Any, what: str, timeout_s: float = 30) -> list[dict[str, Any]]:
        async def probe() -> list[dict[str, Any]]:
            return [e for e in await self.events() if pred(e)]

        return await eventually(probe, timeout_s=timeout_s, interval_s=0.05, what=what)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, **extra: Any) -> Any:
    body = {"model": MODEL_ALIAS, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def subscribed(http: aiohttp.ClientSession, sub: Subscriber, url: str) -> None:
    """Send fresh prompts until one's BlockStored arrives: ZMQ drops what a PUB sends
    before the subscription reaches it."""
    for n in itertools.count():
        prompt = unique(PROMPT * 3)
        await complete(http, url, prompt)
        try:
            await sub.wait_for(lambda e: e["type"] == "BlockStored", "a first batch", 2)
            return
        except AssertionError:
            assert n < 20, "no KV event reached the subscriber"


async def test_kv_events_wire_format(
    servers: Servers, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    prefill = servers.prefill
    sub = Subscriber(zctx, prefill.events_url)
    await subscribed(http, sub, prefill.url)

    # Frames: [topic (empty: no topic configured), seq (8 bytes, big-endian), payload].
    frame = sub.frames[-1]
    assert len(frame) == 3 and frame[0] == b"" and len(frame[1]) == 8
    # The payload is one msgpack EventBatch as an array [ts, events, data_parallel_rank] (0x93);
    # each event a map tagged by "type".
    assert frame[2][0] == 0x93
    ts, events, rank = msgspec.msgpack.decode(frame[2])
    assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
    assert all(isinstance(e, dict) and "type" in e for e in events)

    # A prompt's full blocks: one BlockStored per KV cache group (Gemma 3: five sliding-window
    # groups and one full-attention group), each with the same hashes and token ids.
    sub.frames.clear()
    first = unique(PROMPT * 4)
    ids = await tokenize(http, prefill.url, first)
    await complete(http, prefill.url, first)
    stored = await sub.wait_for(
        lambda e: e["type"] == "BlockStored" and e["token_ids"] == ids[: len(e["token_ids"])],
        "the first prompt's BlockStored",
    )
    assert [e["group_idx"] for e in stored] == [0, 1, 2, 3, 4, 5]
    kinds = [(e["kv_cache_spec_kind"], e.get("kv_cache_spec_sliding_window")) for e in stored]
    assert kinds == [("sliding_window", 512)] * 5 + [("full_attention", None)]
    event = stored[0]
    assert set(event) == BLOCK_STORED_KEYS | {"kv_cache_spec_sliding_window"}
    assert set(stored[5]) == BLOCK_STORED_KEYS  # defaults are omitted, None or not
    assert all(e["block_hashes"] == event["block_hashes"] for e in stored)
    block_size = event["block_size"]
    assert block_size == 32  # --block-size 16 was asked; the CPU backend rounds it up
    hashes = event["block_hashes"]
    assert len(hashes) == len(ids) // block_size
    assert event["token_ids"] == ids[: len(hashes) * block_size]
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
    assert event["parent_block_hash"] is None
    assert event["medium"] == "GPU"  # even on the CPU
    assert event["lora_id"] is None and event["lora_name"] is None
    assert event["extra_keys"] == [None] * len(hashes)

    # The same prompt extended: only its new blocks, chained to the last cached one.
    sub.frames.clear()
    longer = first + " and she lived happily ever after" * 12
    longer_ids = await tokenize(http, prefill.url, longer)
    await complete(http, prefill.url, longer)
    extended = await sub.wait_for(
        lambda e: e["type"] == "BlockStored" and e["parent_block_hash"] == hashes[-1],
        "the extension's BlockStored",
    )
    start = len(hashes) * block_size
    assert extended[0]["token_ids"] == longer_ids[start : start + len(extended[0]["token_ids"])]
    assert not set(extended[0]["block_hashes"]) & set(hashes)

    # Sequence numbers count up by one per batch; the replay socket (ROUTER) answers a DEALER's
    # [b"", start seq] with every buffered batch from there as [b"", topic, seq, payload],
    # then [b"", b"", -1 as 8 signed bytes, b""].
    seqs = [int.from_bytes(f[1], "big") for f in sub.frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(prefill.replay_url)
    await dealer.send_multipart([b"", sub.frames[0][1]])
    replayed: list[list[bytes]] = []
    async with asyncio.timeout(10):
        while True:
            reply = await dealer.recv_multipart()
            if reply[2] == (-1).to_bytes(8, "big", signed=True):
                assert reply == [b"", b"", b"\xff" * 8, b""]
                break
            replayed.append(reply)
    dealer.close(linger=0)
    assert [r[0] for r in replayed] == [b""] * len(replayed)
    assert [r[1:] for r in replayed[: len(sub.frames)]] == sub.frames

    # Evictions: fresh prompts fill the small cache until LRU blocks are reused.
    sub.frames.clear()
    for n in itertools.count():
        await complete(http, prefill.url, unique(PROMPT * 8))
        removed = [e for e in await sub.events() if e["type"] == "BlockRemoved"]
        if removed:
            break
        assert n < 40, "no BlockRemoved after 40 prompts"
    assert {"type", "block_hashes", "medium"} <= set(removed[0])
    assert set(removed[0]) <= {"type", "block_hashes", "medium", "group_idx"}
    assert removed[0]["medium"] == "GPU"
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in removed[0]["block_hashes"])

    # A prefix-cache reset publishes AllBlocksCleared, a map with the tag alone, with the
    # engine's next step (an idle engine publishes nothing until then).
    sub.frames.clear()
    async with http.post(prefill.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200 and (await resp.json()) == {"success": True}
    await complete(http, prefill.url, unique(PROMPT * 3))
    cleared = await sub.wait_for(lambda e: e["type"] == "AllBlocksCleared", "AllBlocksCleared")
    assert cleared[0] == {"type": "AllBlocksCleared"}


async def test_kv_events_of_a_pd_handoff(
    start_router: StartRouter,
    servers: Servers,
    http: aiohttp.ClientSession,
    zctx: zmq.asyncio.Context,
) -> None:
    """Both engines publish the handed-off blocks, under the same hashes (sha256 prefix
    hashing with vLLM's fixed seed): a subscriber can match them across engines."""
    pd = await pd_router(start_router, servers)
    subs = {
        name: Subscriber(zctx, server.events_url)
        for name, server in (("prefill", servers.prefill), ("decode", servers.decode))
    }
    for name, sub in subs.items():
        await subscribed(http, sub, getattr(servers, name).url)
        sub.frames.clear()
    prompt = unique(PROMPT * 3)
    ids = await tokenize(http, servers.prefill.url, prompt)
    client = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0)
    await client.completions.create(model=MODEL_ALIAS, prompt=prompt, max_tokens=2, temperature=0)

    def mine(e: dict[str, Any]) -> bool:
        return bool(e["type"] == "BlockStored" and e["token_ids"] == ids[: len(e["token_ids"])])

    seen = {name: await sub.wait_for(mine, f"{name}'s BlockStored") for name, sub in subs.items()}
    assert seen["prefill"][0]["block_hashes"] == seen["decode"][0]["block_hashes"]
    assert seen["prefill"][0]["token_ids"] == seen["decode"][0]["token_ids"]


async def test_kv_events_place_a_prompt_on_the_vllm_engine_that_holds_its_prefix(
    start_router: StartRouter,
    servers: Servers,
    vllm: VllmInstall,
    http: aiohttp.ClientSession,
) -> None:
    """Issue 30's real-engine check: two vLLM engines (unified), each given a prompt directly,
    behind the router's back, so that only their KV events can tell Narwhal which holds what.
    Requests extending each prompt, through Narwhal, go to its holder: read back from vLLM's own
    prefix-cache counters. Two in a row to each engine, the second engine first: rotation
    (least_loaded's tie-break) alternates, and could not pass."""
    engines = [
        {
            "id": engine_id,
            "url": server.url,
            "role": "both",
            "kv_events": {"endpoint": server.events_url, "replay_endpoint": server.replay_url},
        }
        for engine_id, server in (("a", servers.prefill), ("b", servers.decode))
    ]
    placement = {"policy": "prefix", "tokenizers": {MODEL_ALIAS: str(vllm.tokenizer)}}
    rr = await start_router(engines, placement=placement, **SECTIONS)
    await eventually(lambda: rr.router.ready() is None, timeout_s=30, what="router ready")

    # Under the sliding window (512 tokens) of Gemma 3's first KV-cache group, which is the
    # group Narwhal indexes: its blocks stay until evicted.
    prompts = {"a": unique(PROMPT * 8), "b": unique("In the beginning the sea was dark. " * 14)}

    async def holder(prompt: str) -> str | None:
        body = {"model": MODEL_ALIAS, "prompt": prompt + " The end.", "max_tokens": 1}
        async with http.post(rr.url + "/admin/placement", json=body) as r:
            assert r.status == 200, await r.text()
            view = await r.json()
        best = view["prefill"][0]
        return str(best["id"]) if best["matched_tokens"] > 0 else None

    # Each engine computes its prompt; Narwhal learns where from the events alone. ZMQ drops
    # what a PUB sends before the subscription arrives: resend until the index has it.
    for engine_id, server in (("a", servers.prefill), ("b", servers.decode)):

        async def learned(engine_id: str = engine_id, server: VllmServer = server) -> bool:
            await complete(http, server.url, prompts[engine_id])
            return await holder(prompts[engine_id]) == engine_id

        await eventually(learned, timeout_s=60, interval_s=0.5, what=f"{engine_id}'s events")

    client = openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="unused", max_retries=0)
    for engine_id, server, other in (
        ("b", servers.decode, servers.prefill),
        ("a", servers.prefill, servers.decode),
    ):
        for question in (" What happened next?", " Who was there?"):
            before = [await text_of(http, s.url) for s in (server, other)]
            answer = await client.completions.create(
                model=MODEL_ALIAS, prompt=prompts[engine_id] + question, max_tokens=2, temperature=0
            )
            after = [await text_of(http, s.url) for s in (server, other)]
            hits = [
                metric_sum(new, "vllm:prefix_cache_hits_total")
                - metric_sum(old, "vllm:prefix_cache_hits_total")
                for old, new in zip(before, after, strict=True)
            ]
            assert answer.usage is not None
            # The holder computed the question only; the other engine saw nothing.
            assert hits[0] >= answer.usage.prompt_tokens - 64, (engine_id, question, hits)
            assert metric_sum(after[1], "vllm:prompt_tokens_total") == metric_sum(
                before[1], "vllm:prompt_tokens_total"
            )
    metrics = await text_of(http, rr.url)
    assert metric_sum(metrics, "narwhal_prefix_hit_tokens_total") > 0
