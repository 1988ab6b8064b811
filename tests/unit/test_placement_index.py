"""The block index: exact from events (checked against the simulator's own prefix cache),
approximate and speculative from placements, with time injected."""

from __future__ import annotations

import random

import pytest

from narwhal.placement.events import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from narwhal.placement.index import (
    EXACT_BYTES_PER_BLOCK,
    EXPIRING_BYTES_PER_BLOCK,
    ModelIndex,
    PrefixMatch,
)
from narwhal.placement.keys import prompt_keys
from narwhal.sim import kv_events as sim
from narwhal.sim.prefix_cache import BlockExtras, PrefixCache

BS = 4


def _index() -> ModelIndex:
    return ModelIndex(BS, approximate_ttl_s=100.0, speculative_ttl_s=5.0)


def _stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, **kw)  # type: ignore[arg-type]


def _tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("encoding", list(sim.EventEncoding))
@pytest.mark.parametrize("hash_format", list(sim.BlockHashFormat))
def test_the_exact_index_agrees_with_an_engine_cache(
    encoding: sim.EventEncoding, hash_format: sim.BlockHashFormat
) -> None:
    """Random shared-prefix traffic with evictions and clears: for every prompt, the index's
    matched prefix is exactly what the engine's cache holds."""
    rng = random.Random(f"{encoding}{hash_format}")
    cache = PrefixCache(capacity_blocks=40, block_size=BS, seed=b"engine-seed")
    index = _index()
    decoder = BatchDecoder()
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    extras = [BlockExtras(), BlockExtras(lora_name="sql"), BlockExtras(cache_salt="t1")]

    def publish(events: list[sim.KvEvent]) -> None:
        if events:
            batch = decoder.decode(
                sim.encode_batch(0.0, events, encoding=encoding, hash_format=hash_format)
            )
            assert isinstance(batch, EventBatch)
            index.apply("e1", batch.events)

    checked = 0
    for step in range(400):
        prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
        extra = rng.choice(extras)
        if step % 97 == 96:
            publish(cache.clear())
        allocated = cache.allocate(prompt, extra)
        if allocated is None:
            continue
        alloc, events = allocated
        publish(events)
        publish(cache.store(alloc))
        cache.release(alloc)
        for probe_extra in extras:
            probe = rng.choice(stems) + prompt[-3:]
            engine_keys = cache.block_keys(probe, probe_extra)
            held = 0
            while held < len(engine_keys) and cache.is_cached(engine_keys[held]):
                held += 1
            keys = prompt_keys(
                probe, BS, lora_name=probe_extra.lora_name, cache_salt=probe_extra.cache_salt
            )
            got = index.match(keys, now=0.0).get("e1")
            assert (got.matched_tokens if got else 0) == held * BS
            checked += held
    assert checked > 100  # the traffic did share prefixes
    assert index.blocks("e1") == cache.cached_blocks()


def test_each_engine_gets_its_own_longest_prefix() -> None:
    index = _index()
    tokens = _tokens(16)
    index.apply("a", [_stored([1, 2, 3, 4], None, tokens)])
    index.apply("b", [_stored([9, 8], None, tokens[:8])])
    index.apply("c", [_stored([5], None, [7, 7, 7, 7])])
    keys = prompt_keys([*tokens, 1, 2], BS)
    assert index.match(keys, 0.0) == {"a": PrefixMatch(16, 16), "b": PrefixMatch(8, 8)}
    assert index.match([], 0.0) == {}
    assert index.match(prompt_keys([0, 1, 2], BS), 0.0) == {}


def test_offloaded_blocks_match_but_not_as_gpu() -> None:
    index = _index()
    tokens = _tokens(12)
    index.apply("a", [_stored([1, 2, 3], None, tokens)])
    index.apply("a", [_stored([1, 2, 3], None, tokens, medium="CPU")])
    index.apply("a", [BlockRemoved((2, 3), medium="GPU")])
    keys = prompt_keys(tokens, BS)
    assert index.match(keys, 0.0)["a"] == PrefixMatch(12, 4)
    assert index.match(keys, 0.0)["a"].weighted_tokens(0.5) == 4 + 0.5 * 8
    index.apply("a", [BlockRemoved((3,), medium="cpu")])
    assert index.match(keys, 0.0)["a"] == PrefixMatch(8, 4)


def test_a_block_cached_twice_stays_until_both_copies_go() -> None:
    index = _index()
    tokens = _tokens(4)
    index.apply("a", [_stored([1], None, tokens), _stored([1], None, tokens)])
    index.apply("a", [BlockRemoved((1,))])
    assert index.match(prompt_keys(tokens, BS), 0.0)["a"].matched_tokens == 4
    counts = index.apply("a", [BlockRemoved((1,)), BlockRemoved((1,))])
    assert counts.removed_blocks == 1 and counts.unknown_removals == 1
    assert index.match(prompt_keys(tokens, BS), 0.0) == {} and index.blocks() == 0


def test_blocks_that_cannot_be_keyed_are_counted_and_dropped() -> None:
    index = _index()
    counts = index.apply(
        "a",
        [
            _stored([2], 1, _tokens(4)),  # parent never seen (a gap, or before subscribing)
            BlockStored((3,), None, tuple(_tokens(8)), 8),  # another block size
            _stored([4, 5], None, _tokens(5)),  # tokens for one block only
            _stored([6], None, [-1, 0, 0, 0]),  # not token ids
        ],
    )
    assert counts.unkeyable_blocks == 1 + 1 + 1 + 1 and counts.stored_blocks == 1
    # The block that was keyed is the chain's head; its child comes later and chains on it.
    index.apply("a", [_stored([7], 4, _tokens(4, start=4))])
    assert index.match(prompt_keys(_tokens(8), BS), 0.0)["a"].matched_tokens == 8


def test_other_kv_cache_groups_are_not_indexed() -> None:
    index = _index()
    tokens = _tokens(4)
    index.apply("a", [_stored([1], None, tokens, group_idx=0)])
    counts = index.apply(
        "a", [_stored([1], None, tokens, group_idx=1), BlockRemoved((1,), None, 1)]
    )
    assert counts.other_groups == 2
    assert index.match(prompt_keys(tokens, BS), 0.0)["a"].matched_tokens == 4


def test_lora_and_salt_from_events_match_requests_under_them() -> None:
    index = _index()
    tokens = _tokens(8)
    extra = (("sql", "t1"), ("sql",))
    index.apply("a", [_stored([1, 2], None, tokens, lora_name="sql", extra_keys=extra)])
    assert index.match(prompt_keys(tokens, BS, lora_name="sql", cache_salt="t1"), 0.0)
    assert not index.match(prompt_keys(tokens, BS, lora_name="sql"), 0.0)
    assert not index.match(prompt_keys(tokens, BS, cache_salt="t1"), 0.0)
    # An old vLLM names the adapter by id only: never a match for a named adapter.
    index.apply("b", [_stored([1], None, tokens[:4], lora_id=3)])
    assert "b" not in index.match(prompt_keys(tokens, BS, lora_name="sql"), 0.0)
    assert "b" not in index.match(prompt_keys(tokens, BS), 0.0)


def test_clearing_one_engine_leaves_the_others() -> None:
    index = _index()
    tokens = _tokens(8)
    for engine in ("a", "b"):
        index.apply(engine, [_stored([1, 2], None, tokens)])
    index.note_placed("a", prompt_keys(tokens, BS), 0.0, capacity_blocks=10)
    counts = index.apply("a", [AllBlocksCleared()])
    assert counts.cleared
    assert set(index.match(prompt_keys(tokens, BS), 0.0)) == {"b"}
    assert index.blocks("a") == 0 and index.blocks("b") == 2
    index.drop_engine("b")
    assert index.blocks() == 0 and index.match(prompt_keys(tokens, BS), 0.0) == {}


def test_speculative_entries_count_for_every_engine_until_they_expire() -> None:
    index = _index()
    keys = prompt_keys(_tokens(12), BS)
    index.note_placed("a", keys, now=10.0, capacity_blocks=100)
    assert index.match(keys, now=14.9) == {"a": PrefixMatch(12, 12)}
    assert index.match(keys, now=15.0) == {}  # an engine with events: only the exact tier now
    # Judged approximately, the placement counts until the longer TTL.
    assert index.match(keys, now=109.9, approximate={"a"}) == {"a": PrefixMatch(12, 12)}
    assert index.match(keys, now=110.0, approximate={"a"}) == {}


def test_approximate_engines_ignore_their_exact_entries() -> None:
    index = _index()
    tokens = _tokens(8)
    index.apply("a", [_stored([1, 2], None, tokens)])
    assert index.match(prompt_keys(tokens, BS), 0.0, approximate={"a"}) == {}


def test_the_approximate_tier_is_lru_bounded_tail_first() -> None:
    index = _index()
    first = prompt_keys(_tokens(16), BS)  # 4 blocks
    second = prompt_keys(_tokens(8, start=100), BS)  # 2 blocks
    index.note_placed("a", first, 0.0, capacity_blocks=5)
    index.note_placed("a", second, 1.0, capacity_blocks=5)
    # One block of the older prompt had to go: its tail, so its head still matches.
    assert index.match(first, 2.0, approximate={"a"})["a"].matched_tokens == 12
    assert index.match(second, 2.0, approximate={"a"})["a"].matched_tokens == 8
    assert index.blocks("a") == 5  # one entry per placed block, bounded by the capacity
    # A placement refreshes: the first prompt again, now the second is the oldest.
    index.note_placed("a", first, 3.0, capacity_blocks=5)
    assert index.match(second, 3.0, approximate={"a"})["a"].matched_tokens == 4


def test_expiry_frees_memory_too() -> None:
    index = _index()
    index.note_placed("a", prompt_keys(_tokens(16), BS), 0.0, capacity_blocks=100)
    assert index.blocks() == 4  # one entry per block, read as speculative and approximate
    index.expire(now=5.0)
    assert index.blocks() == 4  # approximate still
    index.expire(now=99.0)
    assert index.blocks() == 4
    index.note_placed("b", prompt_keys(_tokens(4), BS), 100.0, capacity_blocks=100)
    assert index.blocks("a") == 0 and index.blocks("b") == 1


def test_placements_count_for_the_longer_ttl_whichever_it_is() -> None:
    # An odd configuration (the approximate TTL below the speculative one) still holds an
    # approximate engine's placement for the speculative TTL, as every engine's.
    index = ModelIndex(BS, approximate_ttl_s=1.0, speculative_ttl_s=5.0)
    keys = prompt_keys(_tokens(8), BS)
    index.note_placed("a", keys, now=0.0, capacity_blocks=100)
    assert index.match(keys, now=4.9, approximate={"a"}) == {"a": PrefixMatch(8, 8)}
    assert index.match(keys, now=5.0, approximate={"a"}) == {}
    index.expire(now=5.0)
    assert index.blocks() == 0


def test_size_estimate() -> None:
    index = _index()
    index.apply("a", [_stored([1, 2, 3], None, _tokens(12))])
    index.note_placed("b", prompt_keys(_tokens(8), BS), 0.0, capacity_blocks=10)
    assert index.blocks() == 3 + 2
    assert index.estimated_bytes() == 3 * EXACT_BYTES_PER_BLOCK + 2 * EXPIRING_BYTES_PER_BLOCK


def test_block_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="block size"):
        ModelIndex(0, approximate_ttl_s=1.0, speculative_ttl_s=1.0)
