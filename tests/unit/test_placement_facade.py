"""`Placement`: events in through the sequence decision, matches out, hygiene and staleness."""

from __future__ import annotations

import pytest

from narwhal.placement.facade import Placement, PlacementConfig
from narwhal.placement.stream import Verdict
from narwhal.sim import kv_events as sim

BS = 4
TOKENS = list(range(12))


def _placement(*, has_events: bool = True, has_replay: bool = False) -> Placement:
    placement = Placement(PlacementConfig(stale_after_s=10.0, speculative_ttl_s=2.0))
    for engine in ("a", "b"):
        placement.set_engine(
            engine,
            model="m",
            block_size_tokens=BS,
            capacity_tokens=400,
            has_events=has_events,
            has_replay=has_replay,
        )
    return placement


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> bytes:
    digests = [h.to_bytes(8, "big") for h in hashes]
    parent_digest = None if parent is None else parent.to_bytes(8, "big")
    event = sim.BlockStored(tuple(digests), parent_digest, tuple(tokens), BS)
    return sim.encode_batch(0.0, [event], encoding=sim.EventEncoding.MAP)


def _removed(hashes: list[int]) -> bytes:
    event = sim.BlockRemoved(tuple(h.to_bytes(8, "big") for h in hashes))
    return sim.encode_batch(0.0, [event], encoding=sim.EventEncoding.ARRAY)


def _matched(placement: Placement, now: float = 0.0) -> dict[str, int]:
    keys = placement.keys("m", TOKENS)
    return {e: m.matched_tokens for e, m in placement.match("m", keys, now).items()}


def test_in_order_batches_build_the_index_and_count() -> None:
    placement = _placement()
    placement.on_batch("a", 0, _stored([1, 2], None, TOKENS[:8]), 0.0)
    placement.on_batch("a", 1, _stored([3], 2, TOKENS[8:]), 0.0)
    placement.on_batch("b", 0, _stored([1], None, TOKENS[:4]), 0.0)
    assert _matched(placement) == {"a": 12, "b": 4}
    placement.on_batch("a", 2, _removed([3]), 0.0)
    assert _matched(placement) == {"a": 8, "b": 4}
    counters = placement.counters("a")
    assert counters is not None
    assert (counters.batches, counters.stored_blocks, counters.removed_blocks) == (3, 3, 1)
    assert placement.index_blocks("a") == 2 and placement.estimated_bytes() > 0


def test_a_gap_without_replay_forgets_the_engine_and_later_children_cannot_be_keyed() -> None:
    placement = _placement()
    placement.on_batch("a", 0, _stored([1, 2], None, TOKENS[:8]), 0.0)
    decision = placement.on_batch("a", 5, _stored([3], 2, TOKENS[8:]), 0.0)
    assert decision is not None and decision.missed == (1, 4)
    assert _matched(placement) == {}
    counters = placement.counters("a")
    assert counters is not None
    assert (counters.gaps, counters.missed_batches, counters.unkeyable_blocks) == (1, 4, 1)
    assert counters.gaps_seen == 1


def test_a_gap_with_replay_asks_for_it_and_applies_nothing_yet() -> None:
    placement = _placement(has_replay=True)
    placement.on_batch("a", 0, _stored([1], None, TOKENS[:4]), 0.0)
    decision = placement.on_batch("a", 2, _stored([3], 2, TOKENS[8:]), 0.0)
    assert decision is not None and decision.replay_from == 1
    placement.on_batch("a", 1, _stored([2], 1, TOKENS[4:8]), 0.0, replayed=True)
    placement.on_batch("a", 2, _stored([3], 2, TOKENS[8:]), 0.0, replayed=True)
    assert _matched(placement) == {"a": 12}
    counters = placement.counters("a")
    assert counters is not None and counters.replays == 1 and counters.gaps == 0
    assert counters.gaps_seen == 1, "a replayed gap is a gap all the same"


def test_an_undecodable_batch_forgets_the_engine_and_keeps_the_sequence() -> None:
    placement = _placement()
    placement.on_batch("a", 0, _stored([1], None, TOKENS[:4]), 0.0)
    placement.on_batch("a", 1, b"\xc1garbage", 0.0)
    assert _matched(placement) == {}
    decision = placement.on_batch("a", 2, _stored([1], None, TOKENS[:4]), 0.0)
    assert decision is not None and decision.verdict is Verdict.IN_ORDER
    placement.on_garbage("a", "two frames")
    counters = placement.counters("a")
    assert counters is not None and counters.decode_errors == 2


def test_a_restarted_publisher_empties_every_tier_of_that_engine() -> None:
    placement = _placement()
    placement.on_batch("a", 0, _stored([1], None, TOKENS[:4]), 0.0)
    placement.on_batch("a", 1, _stored([2], 1, TOKENS[4:8]), 0.0)
    placement.note_placed("m", "a", placement.keys("m", TOKENS), 0.0, matched_tokens=8)
    decision = placement.on_batch(
        "a", 0, sim.encode_batch(0.0, [], encoding=sim.EventEncoding.MAP), 0.5
    )
    assert decision is not None and decision.verdict is Verdict.RESTART
    assert _matched(placement, now=0.5) == {} and placement.index_blocks("a") == 0
    counters = placement.counters("a")
    assert counters is not None and counters.restarts == 1


def test_hygiene_drop_and_removal() -> None:
    placement = _placement()
    placement.on_batch("a", 0, _stored([1], None, TOKENS[:4]), 0.0)
    placement.drop_engine("a")
    assert _matched(placement) == {}
    # The next message starts over: without replay, what came before is given up.
    decision = placement.on_batch("a", 1, _stored([1], None, TOKENS[:4]), 0.0)
    assert decision is not None and decision.missed == (0, 0) and _matched(placement) == {"a": 4}
    placement.remove_engine("a")
    assert placement.on_batch("a", 2, b"", 0.0) is None and placement.counters("a") is None
    assert _matched(placement) == {}


def test_a_stale_stream_puts_the_engine_on_the_approximate_tier() -> None:
    placement = _placement()
    keys = placement.keys("m", TOKENS)
    placement.on_batch("a", 0, _stored([1], None, TOKENS[:4]), 0.0)
    placement.note_placed("m", "a", keys, 1.0, matched_tokens=4)  # new blocks: events due
    assert not placement.is_stale("a", 10.9) and _matched(placement, 10.9) == {"a": 4}
    assert placement.is_stale("a", 11.0)
    assert placement.approximate_engines("m", 11.0) == {"a"}
    assert _matched(placement, 11.0) == {"a": 12}  # what Narwhal placed there
    placement.on_batch("a", 1, _stored([2], 1, TOKENS[4:8]), 12.0)
    assert not placement.is_stale("a", 12.0) and _matched(placement, 12.0) == {"a": 8}


def test_a_fully_cached_placement_expects_no_event() -> None:
    placement = _placement()
    placement.on_batch("a", 0, _stored([1, 2, 3], None, TOKENS), 0.0)
    placement.note_placed("m", "a", placement.keys("m", TOKENS), 0.0, matched_tokens=12)
    assert not placement.is_stale("a", 1000.0)


def test_engines_without_events_are_approximate() -> None:
    placement = _placement(has_events=False)
    keys = placement.keys("m", TOKENS)
    placement.note_placed("m", "b", keys, 0.0, matched_tokens=0)
    assert placement.approximate_engines("m", 0.0) == {"a", "b"}
    assert _matched(placement, 50.0) == {"b": 12} and not placement.is_stale("b", 1e6)


def test_engine_facts() -> None:
    placement = _placement()
    with pytest.raises(ValueError, match="block size"):
        placement.set_engine(
            "c", model="m", block_size_tokens=8, capacity_tokens=1, has_events=True
        )
    placement.on_batch("a", 0, _stored([1], None, TOKENS[:4]), 0.0)
    placement.set_engine(
        "a", model="other", block_size_tokens=16, capacity_tokens=1, has_events=True
    )
    assert _matched(placement) == {} and placement.keys("nope", TOKENS) == []
    assert placement.match("nope", [1], 0.0) == {}


def test_the_engines_block_size_is_learned_from_their_events_once() -> None:
    """Configured for blocks of 16, engines publishing blocks of 4 (their `--block-size`)
    could never be keyed: the model is indexed in blocks of 4 from their first batch on,
    and its engines' capacities are counted in those blocks."""
    placement = Placement(PlacementConfig())
    for engine in ("a", "b"):
        placement.set_engine(
            engine, model="m", block_size_tokens=16, capacity_tokens=400, has_events=True
        )
    assert placement.block_size("m") == 16
    placement.on_batch("a", 0, _stored([1, 2], None, TOKENS[:8]), 0.0)
    assert placement.block_size("m") == 4
    assert _matched(placement) == {"a": 8}
    counters = placement.counters("a")
    assert counters is not None and counters.unkeyable_blocks == 0
    # the monitor's next sync, with the configured size, is no longer a conflict
    placement.set_engine("b", model="m", block_size_tokens=16, capacity_tokens=400, has_events=True)
    # once learned, another size is not taken up again: counted as unkeyable
    other = sim.BlockStored((b"\x00" * 8,), None, tuple(range(8)), 8)
    placement.on_batch("b", 0, sim.encode_batch(0.0, [other], encoding=sim.EventEncoding.MAP), 0.0)
    assert placement.block_size("m") == 4
    counters = placement.counters("b")
    assert counters is not None and counters.unkeyable_blocks == 1


def test_a_new_engine_joining_a_learned_model_is_sized_in_its_blocks() -> None:
    placement = Placement(PlacementConfig())
    placement.set_engine("a", model="m", block_size_tokens=16, capacity_tokens=400, has_events=True)
    placement.on_batch("a", 0, _stored([1], None, TOKENS[:4]), 0.0)
    placement.set_engine("c", model="m", block_size_tokens=16, capacity_tokens=40, has_events=False)
    keys = placement.keys("m", TOKENS)
    assert len(keys) == 3  # blocks of 4
    placement.note_placed("m", "c", keys, 0.0, matched_tokens=0)
    assert placement.match("m", keys, 0.0)["c"].matched_tokens == 12
