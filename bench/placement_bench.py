"""Placement micro-benchmarks on one core: key hashing, index memory per block, ingestion rate,
and the request path's placement by prefix against placement by load.

    .venv/bin/python -m bench.placement_bench

The numbers go into docs/placement.md and the constants in narwhal/placement/index.py.
"""

from __future__ import annotations

import gc
import hashlib
import random
import time
import tracemalloc
from collections.abc import Callable

from narwhal.placement.events import BatchDecoder, EventBatch
from narwhal.placement.index import ModelIndex
from narwhal.placement.keys import prompt_keys
from narwhal.sim import kv_events as sim

BLOCK = 16


def _best_us(fn: Callable[[], object], repeat: int = 5, number: int = 200) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def _blake2b_keys(tokens: list[int]) -> list[bytes]:
    import array

    data = array.array("I", tokens).tobytes()
    key, keys, step = b"\0" * 8, [], BLOCK * 4
    for off in range(0, (len(tokens) // BLOCK) * step, step):
        key = hashlib.blake2b(data[off : off + step], digest_size=8, key=key).digest()
        keys.append(key)
    return keys


def keys_cost() -> None:
    rng = random.Random(1)
    for n in (1024, 4096, 32768):
        tokens = [rng.randrange(150_000) for _ in range(n)]
        xx = _best_us(lambda t=tokens: prompt_keys(t, BLOCK))  # type: ignore[misc]
        b2 = _best_us(lambda t=tokens: _blake2b_keys(t))  # type: ignore[misc]
        print(f"keys for {n:>6} tokens: xxh3_64 {xx:8.1f} us   blake2b {b2:8.1f} us")


def _stored_batches(prompts: int, blocks: int) -> list[bytes]:
    rng = random.Random(2)
    payloads = []
    for p in range(prompts):
        tokens = tuple(rng.randrange(150_000) for _ in range(blocks * BLOCK))
        hashes = tuple((p * blocks + i).to_bytes(8, "big") for i in range(blocks))
        event = sim.BlockStored(hashes, None, tokens, BLOCK)
        payloads.append(sim.encode_batch(0.0, [event], encoding=sim.EventEncoding.ARRAY))
    return payloads


def memory_per_block() -> None:
    payloads = _stored_batches(2000, 32)
    decoder = BatchDecoder()
    batches = [decoder.decode(p) for p in payloads]
    gc.collect()
    tracemalloc.start()
    index = ModelIndex(BLOCK, approximate_ttl_s=600.0, speculative_ttl_s=5.0)
    before = tracemalloc.get_traced_memory()[0]
    for batch in batches:
        assert isinstance(batch, EventBatch)
        index.apply("e1", batch.events)
    exact = tracemalloc.get_traced_memory()[0] - before
    blocks = index.blocks()
    keys = [prompt_keys(b.events[0].token_ids, BLOCK) for b in batches]  # type: ignore[union-attr]
    before = tracemalloc.get_traced_memory()[0]
    for k in keys:
        index.note_placed("e2", k, 0.0, capacity_blocks=10**9)
    expiring = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"exact index: {exact / blocks:.0f} bytes per block ({blocks} blocks)")
    print(f"placements (approximate and speculative): {expiring / blocks:.0f} bytes per entry")


def ingestion_rate() -> None:
    stored, removed = measure_ingestion()
    print(f"ingestion (decode + apply): stored {stored:,.0f} blocks/s,")
    print(f"  removed {removed:,.0f} blocks/s")


def measure_ingestion() -> tuple[float, float]:
    """Blocks per second one core decodes and applies: (stored, removed), 3,000 batches of
    32 blocks each (the cache suite reports it beside the ingestion its runs asked for)."""
    payloads = _stored_batches(3000, 32)
    removals = [
        sim.encode_batch(
            0.0,
            [sim.BlockRemoved(tuple((p * 32 + i).to_bytes(8, "big") for i in range(32)))],
            encoding=sim.EventEncoding.ARRAY,
        )
        for p in range(3000)
    ]
    index = ModelIndex(BLOCK, approximate_ttl_s=600.0, speculative_ttl_s=5.0)
    decoder = BatchDecoder()
    start = time.perf_counter()
    for payload in payloads:
        batch = decoder.decode(payload)
        assert isinstance(batch, EventBatch)
        index.apply("e1", batch.events)
    stored_s = time.perf_counter() - start
    start = time.perf_counter()
    for payload in removals:
        batch = decoder.decode(payload)
        assert isinstance(batch, EventBatch)
        index.apply("e1", batch.events)
    removed_s = time.perf_counter() - start
    blocks = 3000 * 32
    return blocks / stored_s, blocks / removed_s


def lookup_cost() -> None:
    index = ModelIndex(BLOCK, approximate_ttl_s=600.0, speculative_ttl_s=5.0)
    rng = random.Random(3)
    shared = [rng.randrange(150_000) for _ in range(2048)]
    decoder = BatchDecoder()
    for engine in range(16):
        tokens = shared[: 256 * (engine + 1) // 2] + [rng.randrange(150_000) for _ in range(2048)]
        tokens = tokens[: len(tokens) // BLOCK * BLOCK]
        hashes = tuple((engine * 10_000 + i).to_bytes(8, "big") for i in range(len(tokens) // 16))
        event = sim.BlockStored(hashes, None, tuple(tokens), BLOCK)
        payload = sim.encode_batch(0.0, [event], encoding=sim.EventEncoding.MAP)
        batch = decoder.decode(payload)
        assert isinstance(batch, EventBatch)
        index.apply(f"e{engine}", batch.events)
    prompt = prompt_keys(shared + [1] * 2048, BLOCK)
    cost = _best_us(lambda: index.match(prompt, 0.0))
    print(
        f"match of a 4096-token prompt against 16 engines ({index.blocks()} blocks): {cost:.1f} us"
    )


def request_path_cost() -> None:
    """CPU per request of a leg pair's placement in one process (no I/O, no other worker):
    parse the body, the prompt's ids and keys, the match, the prefill's and the decode's
    pick with their counts and metrics; `prefix` with every prompt distinct (the router-bound
    suite's bodies) and all the same (wrk's), and `least_loaded` with the same bodies."""
    for policy, same in (("least_loaded", False), ("prefix", False), ("prefix", True)):
        one = _request_path(policy, same)
        for i in range(2000):
            one(i)
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            for i in range(20_000):
                one(i)
            best = min(best, (time.process_time() - start) / 20_000)
        bodies = "the same body" if same else "distinct bodies"
        print(f"request path, {policy}, {bodies}: {best * 1e6:.1f} us per request")


def _request_path(policy: str, same: bool) -> Callable[[int], None]:
    import json
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from bench.loadgen.client import _number
    from bench.tokenizer import write_tokenizer
    from narwhal.clock import SystemClock
    from narwhal.config import Role, parse_config
    from narwhal.dataplane.placer import Placer
    from narwhal.dataplane.prefix import PrefixPlacement
    from narwhal.dataplane.requests import parse_request
    from narwhal.fleet.store import Fleet
    from narwhal.telemetry.metrics import DataMetrics

    tokenizer = str(write_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer"))
    config = parse_config(
        {
            "model": "m",
            "engines": [
                {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode"},
            ],
            "placement": {"policy": policy, "tokenizers": {"m": tokenizer}},
        }
    )
    clock = SystemClock()
    fleet = Fleet(config.engines, clock)
    for engine in list(fleet):
        fleet._engines[engine.id] = replace(engine, verified=True, unverified_reason=None)
    prefix = PrefixPlacement(config, clock)
    prefix.sync(fleet, clock.monotonic())
    placer = Placer(config, fleet, clock, prefix, DataMetrics())
    # The router-bound suite's prompt (bench/loadgen/client.py): a shared half, the number.
    words = [f"w{i % 256}" for i in range(28)]
    head, rest = " ".join(words[:16]), " ".join(words[16:])
    bodies = [
        json.dumps(
            {"model": "m", "prompt": f"{head} {_number(i).decode()} bnchld {rest}", "max_tokens": 8}
        ).encode()
        for i in range(1 if same else 20_000)
    ]

    def one(i: int) -> None:
        req = parse_request("completions", bodies[0 if same else i], "m")
        prompt = prefix.prompt_now(req, "m") if prefix.enabled else None
        cached = prefix.match(prompt) if prompt is not None else None
        tried: set[str] = set()
        with placer.placed(Role.PREFILL, tried, "m", prompt, cached):
            pass
        with placer.placed(Role.DECODE, tried, "m", prompt, cached):
            pass

    return one


if __name__ == "__main__":
    keys_cost()
    memory_per_block()
    ingestion_rate()
    lookup_cost()
    request_path_cost()
