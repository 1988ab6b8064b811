"""Sequence tracking of one engine's event stream: a table of (state, message) -> decision."""

from __future__ import annotations

import pytest

from narwhal.placement.stream import (
    SeqDecision,
    StreamState,
    Verdict,
    decide,
    is_stale,
    note_placed,
    replay_failed,
    reset,
)

FRESH = StreamState()
AT_5 = StreamState(expected=5, live_high=4)  # applied 0..4 live
V = Verdict


@pytest.mark.parametrize(
    ("state", "seq", "replayed", "replay", "decision", "expected_after"),
    [
        # The first message: from 0 nothing was missed; later, replay from 0 or give up 0..seq-1.
        (FRESH, 0, False, True, SeqDecision(V.FIRST, apply=True), 1),
        (FRESH, 7, False, True, SeqDecision(V.FIRST, apply=False, replay_from=0), None),
        (
            FRESH,
            7,
            False,
            False,
            SeqDecision(V.FIRST, apply=True, drop_entries=True, missed=(0, 6)),
            8,
        ),
        # In order, duplicate (delivered by a replay), gap.
        (AT_5, 5, False, False, SeqDecision(V.IN_ORDER, apply=True), 6),
        (StreamState(expected=9, live_high=4), 6, False, True, SeqDecision(V.DUPLICATE, False), 9),
        (AT_5, 8, False, True, SeqDecision(V.GAP, apply=False, replay_from=5), 5),
        (AT_5, 8, False, False, SeqDecision(V.GAP, True, drop_entries=True, missed=(5, 7)), 9),
        # Backwards below the live high-water mark: a new publisher.
        (AT_5, 0, False, True, SeqDecision(V.RESTART, apply=True, drop_entries=True), 1),
        (
            AT_5,
            3,
            False,
            True,
            SeqDecision(V.RESTART, False, drop_entries=True, replay_from=0),
            None,
        ),
        (
            AT_5,
            4,
            False,
            False,
            SeqDecision(V.RESTART, True, drop_entries=True, missed=(0, 3)),
            5,
        ),
        # Replayed messages: in order, duplicates, and a gap a replay cannot fill.
        (FRESH, 0, True, True, SeqDecision(V.FIRST, apply=True), 1),
        (FRESH, 3, True, True, SeqDecision(V.GAP, True, drop_entries=True, missed=(0, 2)), 4),
        (AT_5, 5, True, True, SeqDecision(V.IN_ORDER, apply=True), 6),
        (AT_5, 2, True, True, SeqDecision(V.DUPLICATE, apply=False), 5),
        (AT_5, 9, True, True, SeqDecision(V.GAP, True, drop_entries=True, missed=(5, 8)), 10),
    ],
)
def test_decisions(
    state: StreamState,
    seq: int,
    replayed: bool,
    replay: bool,
    decision: SeqDecision,
    expected_after: int | None,
) -> None:
    after, got = decide(state, seq, replayed=replayed, replay_available=replay, now=1.0)
    assert got == decision
    assert after.expected == expected_after


def test_a_gap_replayed_then_the_live_backlog_is_duplicates_then_in_order() -> None:
    state, d = decide(AT_5, 8, replayed=False, replay_available=True, now=0.0)
    assert d.replay_from == 5
    for seq in (5, 6, 7, 8, 9):  # the replay reaches past the message that revealed the gap
        state, d = decide(state, seq, replayed=True, replay_available=True, now=0.0)
        assert d.apply
    state, d = decide(state, 8, replayed=True, replay_available=True, now=0.0)  # fed again
    assert d.verdict is V.DUPLICATE
    state, d = decide(state, 9, replayed=False, replay_available=True, now=0.0)  # live backlog
    assert d.verdict is V.DUPLICATE
    state, d = decide(state, 10, replayed=False, replay_available=True, now=0.0)
    assert d == SeqDecision(V.IN_ORDER, apply=True)


def test_a_failed_replay_gives_the_gap_up_and_blocks_replays_for_a_while() -> None:
    state, d = decide(AT_5, 8, replayed=False, replay_available=True, now=10.0)
    assert d.replay_from == 5
    state = replay_failed(state, now=10.0, retry_after_s=30.0)
    state, d = decide(state, 8, replayed=True, replay_available=True, now=10.0)  # fed again
    assert d == SeqDecision(V.GAP, True, drop_entries=True, missed=(5, 7))
    state, d = decide(state, 12, replayed=False, replay_available=True, now=20.0)
    assert d.replay_from is None and d.missed == (9, 11)
    state, d = decide(state, 20, replayed=False, replay_available=True, now=40.0)
    assert d.replay_from == 13


def test_reset_starts_over_but_still_knows_the_publisher() -> None:
    state = reset(AT_5)
    assert state.expected is None and state.live_high == 4
    _, d = decide(state, 9, replayed=False, replay_available=True, now=0.0)
    assert d == SeqDecision(V.FIRST, apply=False, replay_from=0)
    _, d = decide(state, 2, replayed=False, replay_available=False, now=0.0)
    assert d.verdict is V.RESTART


def test_stale_only_when_placed_work_stored_nothing_for_long() -> None:
    assert not is_stale(FRESH, now=1e9, stale_after_s=10.0)  # silence alone is not staleness
    state = note_placed(AT_5, now=100.0)
    state = note_placed(state, now=105.0)  # the first unconfirmed placement counts
    assert not is_stale(state, now=109.9, stale_after_s=10.0)
    assert is_stale(state, now=110.0, stale_after_s=10.0)
    state, _ = decide(state, 5, replayed=False, replay_available=False, now=111.0)
    assert not is_stale(state, now=500.0, stale_after_s=10.0)
    # A message that is not applied (a duplicate) confirms nothing.
    state = note_placed(StreamState(expected=9, live_high=4), now=0.0)
    state, _ = decide(state, 6, replayed=False, replay_available=False, now=1.0)
    assert is_stale(state, now=10.0, stale_after_s=10.0)
