"""The sim's prefix cache (pure) and the wire encodings of its KV events."""

from __future__ import annotations

import msgspec
import pytest

from narwhal.sim.kv_events import (
    AllBlocksCleared,
    BlockHashFormat,
    BlockRemoved,
    BlockStored,
    EventEncoding,
    encode_batch,
    external_hash,
)
from narwhal.sim.prefix_cache import Allocation, BlockExtras, PrefixCache

SEED = b"0123456789abcdef"


def cache(capacity: int = 8, size: int = 4) -> PrefixCache:
    return PrefixCache(capacity, size, SEED)


def run(c: PrefixCache, tokens: list[int]) -> Allocation:
    """A request from admission to its prefill: allocated and stored, not yet released."""
    got = c.allocate(tokens)
    assert got is not None
    alloc, _ = got
    c.store(alloc)
    return alloc


def test_keys_chain_so_a_block_s_key_depends_on_everything_before_it() -> None:
    c = cache()
    a = c.block_keys([1, 2, 3, 4, 5, 6, 7, 8], BlockExtras())
    b = c.block_keys([9, 2, 3, 4, 5, 6, 7, 8], BlockExtras())
    assert len(a) == 2 and a[1] != b[1]  # same second block, other first block
    assert c.block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BlockExtras()) == a  # partial tail: no key
    assert c.block_keys([1, 2, 3, 4], BlockExtras(lora_name="x"))[0] != a[0]
    salted = c.block_keys([1, 2, 3, 4, 5, 6, 7, 8], BlockExtras(cache_salt="s"))
    assert salted[0] != a[0] and salted[1] != a[1]  # the salt keys the first block only...
    assert PrefixCache(8, 4, b"another seed....").block_keys([1, 2, 3, 4], BlockExtras()) != a[:1]


def test_a_repeated_prompt_hits_its_full_blocks_but_always_computes_its_last_token() -> None:
    c = cache()
    first = run(c, list(range(10)))  # 2 full blocks + 2 tokens
    assert first.hit_tokens == 0
    c.release(first)
    second = run(c, list(range(10)))
    assert second.hit_tokens == 8
    c.release(second)
    aligned = run(c, list(range(8)))  # whole blocks: the last one is recomputed
    assert aligned.hit_tokens == 4
    assert (c.queried_tokens, c.hit_tokens) == (28, 12)


def test_match_says_what_a_request_would_hit_and_changes_nothing() -> None:
    c = cache()
    assert c.match(list(range(10))) == 0
    c.release(run(c, list(range(10))))
    before = (c.queried_tokens, c.hit_tokens, c.usage())
    assert c.match(list(range(10))) == 8
    assert c.match(list(range(8))) == 4  # the last token is always computed
    assert c.match([0, 1, 2, 3, 99, 5, 6, 7, 8]) == 4
    assert c.match(list(range(10)), BlockExtras(lora_name="x")) == 0
    assert (c.queried_tokens, c.hit_tokens, c.usage()) == before
    assert c.match(list(range(10))) == run(c, list(range(10))).hit_tokens


def test_store_emits_the_new_blocks_with_their_tokens_and_parent() -> None:
    c = cache()
    got = c.allocate(list(range(10)))
    assert got is not None and got[1] == []
    [stored] = c.store(got[0])
    assert isinstance(stored, BlockStored)
    keys = c.block_keys(list(range(10)), BlockExtras())
    assert stored.block_hashes == tuple(keys)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tuple(range(8))
    assert stored.block_size == 4 and stored.medium == "GPU" and stored.extra_keys is None
    c.release(got[0])
    # A longer prompt sharing the first block stores only what is new, its parent named.
    longer = c.allocate([0, 1, 2, 3, 4, 5, 6, 70, 8, 9, 10, 11, 12])
    assert longer is not None
    [more] = c.store(longer[0])
    assert isinstance(more, BlockStored)
    assert more.parent_block_hash == keys[0]
    assert more.token_ids == (4, 5, 6, 70, 8, 9, 10, 11)


def test_lora_and_salt_are_named_in_the_stored_event() -> None:
    c = cache()
    extras = BlockExtras(lora_name="sql", lora_id=1, cache_salt="tenant")
    got = c.allocate(list(range(8)), extras)
    assert got is not None
    [stored] = c.store(got[0])
    assert isinstance(stored, BlockStored)
    assert (stored.lora_name, stored.lora_id) == ("sql", 1)
    assert stored.extra_keys == (("sql", "tenant"), ("sql",))


def test_unreferenced_blocks_are_evicted_least_recently_used_first_tail_before_head() -> None:
    c = cache(capacity=4)
    a = run(c, [1, 2, 3, 4, 5, 6, 7, 8])
    c.release(a)
    b = run(c, [9, 9, 9, 9, 8, 8, 8, 8])
    c.release(b)
    assert c.cached_blocks() == 4 and c.usage() == 0.0
    # a is older, but this prompt uses a's blocks: its tail's block evicts b's tail, not b's head.
    got = c.allocate([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert got is not None and got[0].hit_tokens == 8
    b_keys = c.block_keys([9, 9, 9, 9, 8, 8, 8, 8], BlockExtras())
    assert got[1] == [BlockRemoved((b_keys[1],))]
    assert c.is_cached(b_keys[0]) and not c.is_cached(b_keys[1])


def test_a_prompt_that_does_not_fit_beside_running_requests_waits() -> None:
    c = cache(capacity=4)
    held = run(c, list(range(12)))  # 3 blocks in use
    assert c.usage() == 0.75
    assert c.allocate(list(range(100, 108))) is None  # needs 2, 1 is free
    assert (c.queried_tokens, c.hit_tokens) == (12, 0)  # a refused allocation is no query
    c.release(held)
    assert c.allocate(list(range(100, 108))) is not None


def test_a_shared_block_is_stored_once_and_held_until_its_last_user_ends() -> None:
    c = cache(capacity=4)
    first, second = c.allocate([1, 2, 3, 4, 5]), c.allocate([1, 2, 3, 4, 6])
    assert first is not None and second is not None  # both miss: neither has stored yet
    assert len(c.store(first[0])) == 1
    assert c.store(second[0]) == []  # the block is already there: shared
    assert c.usage() == 0.75  # one shared full block + two tails
    c.release(first[0])
    assert c.usage() == 0.5
    c.release(second[0])
    assert c.usage() == 0.0 and c.cached_blocks() == 1


def test_clear_drops_the_cache_and_running_requests_keep_their_blocks_uncached() -> None:
    c = cache(capacity=4)
    idle = run(c, [1, 2, 3, 4])
    c.release(idle)
    running = run(c, [5, 6, 7, 8, 9])
    assert c.clear() == [AllBlocksCleared()]
    assert c.cached_blocks() == 0 and c.usage() == 0.5
    assert c.store(running) == []
    c.release(running)
    assert c.usage() == 0.0
    again = run(c, [5, 6, 7, 8, 9])
    assert again.hit_tokens == 0


EVENTS = [
    BlockStored((b"\x01" * 32, b"\x02" * 32), None, (1, 2, 3, 4, 5, 6, 7, 8), 4),
    BlockRemoved((b"\x01" * 32,)),
    AllBlocksCleared(),
]


def test_array_encoding_is_vllm_s_legacy_positional_layout() -> None:
    batch = msgspec.msgpack.decode(encode_batch(1.5, EVENTS, encoding=EventEncoding.ARRAY))
    h1, h2 = (external_hash(b"\x01" * 32, BlockHashFormat.INT), 0x0202020202020202)
    assert batch == [
        1.5,
        [
            ["BlockStored", [h1, h2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None],
            ["BlockRemoved", [h1], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert h1 == 0x0101010101010101


@pytest.mark.parametrize("encoding", [EventEncoding.MAP, EventEncoding.MIXED])
def test_map_encodings_tag_each_event_with_its_class_name(encoding: EventEncoding) -> None:
    raw = encode_batch(2.0, EVENTS, encoding=encoding, hash_format=BlockHashFormat.BYTES)
    batch = msgspec.msgpack.decode(raw)
    events = batch["events"] if encoding is EventEncoding.MAP else batch[1]
    if encoding is EventEncoding.MAP:
        assert batch == {"ts": 2.0, "events": events, "data_parallel_rank": 0}
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32, b"\x02" * 32],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert events[1:] == [
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]


def test_extra_keys_are_sent_when_a_block_has_them() -> None:
    event = BlockStored((b"\x01" * 32,), None, (1, 2), 2, 3, "sql", (("sql",),))
    [wire] = msgspec.msgpack.decode(encode_batch(0.0, [event], encoding=EventEncoding.ARRAY))[1]
    assert wire[5:] == [3, "GPU", "sql", [["sql"]]]
