"""KV events from real narwhal-sim processes, read as a router reads them: a ZMQ SUB socket on
the publisher and a DEALER on its replay socket, payloads decoded as plain msgpack."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

from narwhal.clock import SystemClock
from narwhal.sim.faults import FaultBook
from narwhal.sim.kv_events import BlockStored
from narwhal.sim.kv_publisher import KvEventPublisher, PublisherConfig
from tests.support.poll import eventually
from tests.support.sim_process import SimFactory, SimProcess

from .helpers import complete, decode_body, post, prefill_body
from .test_cli import sim_cli, start_up_failure

BLOCK = 4
PROMPT = " ".join(f"w{i}" for i in range(10))  # 10 tokens: 2 full blocks and a partial one
END = (-1).to_bytes(8, "big", signed=True)


def events_sim(factory: SimFactory, *args: str) -> SimProcess:
    return factory(
        "--itl-ms",
        "0",
        "--max-model-len",
        "64",
        "--block-size",
        str(BLOCK),
        "--kv-blocks",
        "16",
        "--kv-events-port",
        "0",
        "--kv-events-replay-port",
        "0",
        "--kv-events-topic",
        "kv@sim",
        *args,
    )


@dataclass
class Message:
    topic: bytes
    seq: int
    batch: Any

    def events(self) -> list[Any]:
        """The batch's events as maps with `type` (array events turned into maps)."""
        raw = self.batch["events"] if isinstance(self.batch, dict) else self.batch[1]
        return [e if isinstance(e, dict) else _array_event(e) for e in raw]


def _array_event(e: list[Any]) -> dict[str, Any]:
    names = {
        "BlockStored": [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
        ],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    }[e[0]]
    return {"type": e[0], **dict(zip(names, e[1:], strict=False))}


class Subscriber:
    """A SUB socket on a sim's publisher, subscribed once a probe event got through."""

    def __init__(self, ctx: zmq.asyncio.Context, sim: SimProcess) -> None:
        self.sim = sim
        self.info: dict[str, Any] = sim.get_json("/sim/kv_events")
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(self.info["endpoint"])
        self.ctx = ctx

    async def joined(self) -> None:
        """PUB drops what it sends before a subscription arrives: reset the (empty) cache
        until one AllBlocksCleared gets through, then drain."""

        async def probe() -> bool:
            await asyncio.to_thread(self.sim.http, "POST", "/reset_prefix_cache")
            return await self.sock.poll(50) != 0

        await eventually(probe, what="the subscription to take")
        while await self.sock.poll(100):
            await self.sock.recv_multipart()

    async def next(self, timeout_s: float = 5.0) -> Message:
        async with asyncio.timeout(timeout_s):
            topic, seq, payload = await self.sock.recv_multipart()
        return Message(topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload))

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Ask the replay socket for batches from `start`; the frames up to the end marker."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.info["replay_endpoint"])
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            async with asyncio.timeout(5):
                while True:
                    empty, seq, payload = await dealer.recv_multipart()
                    assert empty == b""
                    if seq == END:
                        assert payload == b""
                        return got
                    got.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def subscribed(ctx: zmq.asyncio.Context, sim: SimProcess) -> Subscriber:
    sub = Subscriber(ctx, sim)
    await sub.joined()
    return sub


@pytest.mark.parametrize("encoding", ["array", "mixed", "map"])
async def test_a_prefill_publishes_its_full_blocks_with_their_token_ids(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context, encoding: str
) -> None:
    sim = events_sim(sim_factory, "--kv-events-encoding", encoding)
    sub = await subscribed(zctx, sim)
    tokens = sim.post_json("/tokenize", {"prompt": PROMPT})["tokens"]
    answer = await asyncio.to_thread(complete, sim, {"prompt": PROMPT, "max_tokens": 2})
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    message = await sub.next()
    assert message.topic == b"kv@sim"
    assert isinstance(message.batch, dict) is (encoding == "map")
    [stored] = message.events()
    assert stored["type"] == "BlockStored"
    assert stored["token_ids"] == tokens[:8]  # the two full blocks; the partial one is not
    assert stored["block_size"] == BLOCK
    assert stored["parent_block_hash"] is None
    assert stored["medium"] == "GPU" and stored["lora_name"] is None
    assert len(stored["block_hashes"]) == 2
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in stored["block_hashes"])
    # The same prompt again is a cache hit: nothing new is stored.
    again = await asyncio.to_thread(complete, sim, {"prompt": PROMPT, "max_tokens": 2})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    longer = PROMPT + " x y"  # 12 tokens: a third full block, its parent the second
    await asyncio.to_thread(complete, sim, {"prompt": longer, "max_tokens": 2})
    third = await sub.next()
    assert third.seq == message.seq + 1
    [more] = third.events()
    assert more["parent_block_hash"] == stored["block_hashes"][1]
    assert more["token_ids"] == sim.post_json("/tokenize", {"prompt": longer})["tokens"][8:]
    sub.close()


async def test_two_engines_hash_the_same_prompt_differently(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    """Block hashes are seeded per process, as vLLM's: a router must not depend on them."""
    hashes = []
    for sim in (events_sim(sim_factory), events_sim(sim_factory)):
        sub = await subscribed(zctx, sim)
        await asyncio.to_thread(complete, sim, {"prompt": PROMPT, "max_tokens": 1})
        [stored] = (await sub.next()).events()
        hashes.append(stored["block_hashes"])
        sub.close()
    assert hashes[0] != hashes[1]


async def test_a_dropped_message_leaves_a_gap_that_replay_fills(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    sim = events_sim(sim_factory, "--kv-events-block-hash", "bytes")
    sub = await subscribed(zctx, sim)
    sim.add_fault({"kind": "kv_events_drop", "count": 1})
    await asyncio.to_thread(complete, sim, {"prompt": PROMPT, "max_tokens": 1})
    await asyncio.to_thread(complete, sim, {"prompt": "other words " * 3, "max_tokens": 1})
    after = await sub.next()
    missed = after.seq - 1
    replayed = await sub.replay(missed)
    assert [seq for seq, _ in replayed] == [missed, after.seq]
    [stored] = Message(b"", missed, msgspec.msgpack.decode(replayed[0][1])).events()
    assert stored["token_ids"] == sim.post_json("/tokenize", {"prompt": PROMPT})["tokens"][:8]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in stored["block_hashes"])
    assert sim.get_json("/sim/kv_events")["dropped"] == 1
    sub.close()


async def test_eviction_and_reset_are_published(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    sim = events_sim(sim_factory)
    sub = await subscribed(zctx, sim)
    await asyncio.to_thread(complete, sim, {"prompt": PROMPT, "max_tokens": 1})
    [stored] = (await sub.next()).events()
    # 16 blocks: a 64-token prompt needs them all, so every cached block is evicted.
    big = " ".join(f"b{i}" for i in range(64))
    await asyncio.to_thread(complete, sim, {"prompt": big, "max_tokens": 1})
    removed, stored_big = (await sub.next()).events(), (await sub.next()).events()
    assert removed == [
        {"type": "BlockRemoved", "block_hashes": stored["block_hashes"][::-1], "medium": "GPU"}
    ]
    assert len(stored_big[0]["block_hashes"]) == 16
    assert sim.post_json("/reset_prefix_cache", {}) is None
    assert (await sub.next()).events() == [{"type": "AllBlocksCleared"}]
    sub.close()


async def test_a_restart_numbers_from_zero_and_silence_sends_nothing(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    sim = events_sim(sim_factory)
    sub = await subscribed(zctx, sim)
    assert sim.get_json("/sim/kv_events")["next_sequence"] > 0
    sim.add_fault({"kind": "restart"})  # a new process: sequence from 0, cache empty, no event
    await asyncio.to_thread(complete, sim, {"prompt": PROMPT, "max_tokens": 1})
    message = await sub.next()
    assert message.seq == 0 and message.events()[0]["type"] == "BlockStored"
    silent = sim.add_fault({"kind": "kv_events_silent"})
    await asyncio.to_thread(complete, sim, {"prompt": "quiet words " * 3, "max_tokens": 1})
    assert await sub.sock.poll(300) == 0
    sim.remove_fault(silent["id"])
    await asyncio.to_thread(complete, sim, {"prompt": "loud words " * 3, "max_tokens": 1})
    assert (await sub.next()).seq == 2  # 1 was numbered during the silence, and not sent
    sub.close()


async def test_a_decode_engine_caches_the_blocks_it_loaded(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    prefill = events_sim(sim_factory, "--kv-role", "kv_producer")
    decode = events_sim(sim_factory, "--kv-role", "kv_consumer")
    sub = await subscribed(zctx, decode)
    body = {"prompt": PROMPT, "max_tokens": 3}
    params = (await asyncio.to_thread(complete, prefill, prefill_body(body)))["kv_transfer_params"]
    answer = await asyncio.to_thread(complete, decode, decode_body(body, params))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 10  # all loaded
    [stored] = (await sub.next()).events()
    assert stored["token_ids"] == decode.post_json("/tokenize", {"prompt": PROMPT})["tokens"][:8]
    sub.close()


def test_the_cache_and_queue_metrics_are_vllm_s(sim_factory: SimFactory) -> None:
    sim = events_sim(sim_factory)
    complete(sim, {"prompt": PROMPT, "max_tokens": 1})
    complete(sim, {"prompt": PROMPT, "max_tokens": 1})
    text = sim.metrics()
    assert 'vllm:prefix_cache_queries_total{model_name="demo-model"} 20.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="demo-model"} 8.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="demo-model"} 0.0' in text
    assert 'vllm:num_requests_waiting{model_name="demo-model"} 0.0' in text
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="4"' in info and 'num_gpu_blocks="16"' in info


def test_without_a_cache_nothing_is_cached_and_no_cache_metric_is_shown(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--itl-ms", "0")
    for _ in range(2):
        answer = complete(sim, {"prompt": PROMPT, "max_tokens": 1})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "vllm:prefix_cache" not in sim.metrics()
    assert sim.http("GET", "/sim/kv_events")[0] == 404
    assert sim.http("POST", "/reset_prefix_cache")[0] == 400


def _write_tokenizer(path: Path) -> Tokenizer:
    """A small word-level tokenizer.json that adds a BOS token, as a model's would."""
    vocab = {"[UNK]": 0, "<s>": 1} | {f"w{i}": i + 2 for i in range(40)}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return tok


async def test_with_a_tokenizer_file_the_token_ids_are_the_model_s(
    sim_factory: SimFactory, zctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    expected = _write_tokenizer(tmp_path / "tokenizer.json").encode(PROMPT).ids
    assert expected[:3] == [1, 2, 3]  # BOS, w0, w1
    sim = events_sim(sim_factory, "--tokenizer", str(tmp_path))
    assert sim.post_json("/tokenize", {"prompt": PROMPT})["tokens"] == expected
    sub = await subscribed(zctx, sim)
    await asyncio.to_thread(complete, sim, {"prompt": PROMPT, "max_tokens": 1})
    [stored] = (await sub.next()).events()
    assert stored["token_ids"] == expected[:8]
    assert sim.post_json("/detokenize", {"tokens": expected[1:3]})["prompt"] == "w0 w1"
    sub.close()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--kv-events-port", "0"], "--kv-events-port"),
        (["--kv-blocks", "300", "--kv-events-replay-port", "0"], "--kv-events-replay-port"),
        (["--kv-blocks", "2"], "--kv-blocks"),
        (["--kv-events-drop-fraction", "1.5"], "--kv-events-drop-fraction"),
        (["--kv-events-encoding", "json"], "--kv-events-encoding"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
    ],
)
def test_cache_and_event_options_that_cannot_work_are_usage_errors(
    args: list[str], named: str
) -> None:
    result = sim_cli("serve", *args)
    assert result.returncode == 2, result.stderr
    (error,) = result.stderr.splitlines()
    assert error.startswith("narwhal-sim serve: error: ") and named in error, error


def test_a_busy_event_port_is_a_start_up_failure() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--port", "0", "--kv-blocks", "300", "--kv-events-port", str(port)]
        lines = start_up_failure(sim_cli("serve", *args))
    assert len(lines) == 1 and "KV events: cannot bind" in lines[0] and str(port) in lines[0]


def test_cache_match_tells_the_true_cached_prefix_and_changes_nothing(
    sim_factory: SimFactory,
) -> None:
    """`POST /sim/cache/match` (the benchmark's oracle): the tokens a completion or chat
    body would find cached now; asking changes neither the cache nor its counters; a sim
    without a cache says so with a 400."""
    sim = events_sim(sim_factory)
    body = {"prompt": PROMPT, "max_tokens": 1}
    assert sim.post_json("/sim/cache/match", body) == {"prompt_tokens": 10, "cached_tokens": 0}
    complete(sim, body)
    queries = sim.metric("vllm:prefix_cache_queries_total")
    assert sim.post_json("/sim/cache/match", body) == {"prompt_tokens": 10, "cached_tokens": 8}
    assert sim.post_json("/sim/cache/match", {"prompt": "w0 w1 w2 w3 w9"})["cached_tokens"] == 4
    chat = {"messages": [{"role": "user", "content": PROMPT}]}
    assert sim.post_json("/sim/cache/match", chat)["cached_tokens"] == 0
    assert sim.metric("vllm:prefix_cache_queries_total") == queries
    status, answer = post(sim, "/sim/cache/match", {"prompt": PROMPT, "model": "nope"})
    assert status == 404, answer
    plain = sim_factory("--itl-ms", "0")
    status, answer = post(plain, "/sim/cache/match", body)
    assert status == 400 and "without a prefix cache" in answer["error"]["message"]


async def test_a_replay_longer_than_zmq_s_default_queue_arrives_whole_with_its_end(
    zctx: zmq.asyncio.Context,
) -> None:
    """10,000 batches buffered, the publisher's (and vLLM's) whole buffer (a ROUTER's default
    high-water mark is 1,000, past which it drops, the end marker included): a replay from 0
    delivers every one, then the end."""
    N = 10_000
    rng = random.Random(0)
    config = PublisherConfig(host="127.0.0.1", port=0, replay_port=0)
    publisher = KvEventPublisher(
        config, clock=SystemClock(), rng=rng, faults=FaultBook(rng, lambda _: None)
    )
    publisher.open()
    serving = asyncio.create_task(publisher.serve_replay())
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        blocks = 64  # about 2.5 KB a batch: the kernel's socket buffers fill, the queue grows
        stored = BlockStored((bytes(32),) * blocks, None, tuple(range(BLOCK * blocks)), BLOCK)
        for _ in range(N):
            publisher.publish([stored])
        dealer.connect(f"tcp://127.0.0.1:{publisher.replay_port}")
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        async with asyncio.timeout(30):
            while True:
                _, seq, _ = await dealer.recv_multipart()
                if seq == END:
                    break
                seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(N))
    finally:
        dealer.close()
        serving.cancel()
        publisher.close()
