"""Per-engine KV-event sequence tracking: apply, ignore, replay or drop, and staleness.

A pure decision over a frozen `StreamState`, so every case is a table row. The rules:
- Live messages of one publisher arrive in strictly increasing sequence (PUB/SUB over one
  connection neither reorders nor repeats), so a live sequence at or below the highest live one
  seen means a new publisher: the engine restarted, its cache is empty (`RESTART`).
- A live sequence above the expected one is a gap: fetch it from the replay endpoint when there
  is one (and it has not just failed), else forget what the engine holds and go on.
- Replayed messages (and the live message that triggered the replay, fed again after it) are
  applied in order; what the replay already delivered comes in again live and is a `DUPLICATE`;
  a gap inside a replay (the publisher's buffer no longer reaches back) cannot be replayed again.
- Stale: Narwhal placed a prefill there that should have stored blocks, and no batch arrived
  within `stale_after_s`. Silence alone is not staleness: an idle engine publishes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Verdict(StrEnum):
    FIRST = "first"
    """The first message since subscribing (or since the engine's entries were dropped)."""
    IN_ORDER = "in_order"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


@dataclass(frozen=True, slots=True)
class StreamState:
    expected: int | None = None
    """The next sequence to apply; None: nothing applied since the last reset."""
    live_high: int | None = None
    """The highest sequence received live from the current publisher."""
    unconfirmed_since: float | None = None
    """When Narwhal first placed work expected to store blocks since the last applied batch."""
    replay_blocked_until: float | None = None
    """A replay failed: no replay is asked for before this time."""


@dataclass(frozen=True, slots=True)
class SeqDecision:
    verdict: Verdict
    apply: bool
    """Apply this message's batch now."""
    drop_entries: bool = False
    """Forget the engine's exact entries first (a gap that cannot be replayed, a restart)."""
    replay_from: int | None = None
    """Fetch sequences from here on from the replay endpoint, then feed this message again as
    replayed; do not apply it now."""
    missed: tuple[int, int] | None = None
    """The sequences known lost (inclusive), when the decision gives them up."""


def decide(
    state: StreamState,
    seq: int,
    *,
    replayed: bool,
    replay_available: bool,
    now: float,
) -> tuple[StreamState, SeqDecision]:
    """What to do with the message `seq` (live, or from a replay) and the state after it."""
    if replayed:
        return _replayed(state, seq, now)
    may_replay = replay_available and (
        state.replay_blocked_until is None or now >= state.replay_blocked_until
    )
    live_high = seq if state.live_high is None else max(seq, state.live_high)
    if state.live_high is not None and seq <= state.live_high:
        fresh = StreamState(
            live_high=seq,
            unconfirmed_since=state.unconfirmed_since,
            replay_blocked_until=state.replay_blocked_until,
        )
        return _from_start(fresh, seq, now, may_replay, Verdict.RESTART, restart=True)
    state = replace(state, live_high=live_high)
    if state.expected is None:
        return _from_start(state, seq, now, may_replay, Verdict.FIRST, restart=False)
    if seq == state.expected:
        return _applied(state, seq, now), SeqDecision(Verdict.IN_ORDER, apply=True)
    if seq < state.expected:
        return state, SeqDecision(Verdict.DUPLICATE, apply=False)
    if may_replay:
        return state, SeqDecision(Verdict.GAP, apply=False, replay_from=state.expected)
    missed = (state.expected, seq - 1)
    decision = SeqDecision(Verdict.GAP, apply=True, drop_entries=True, missed=missed)
    return _applied(state, seq, now), decision


def _from_start(
    state: StreamState, seq: int, now: float, may_replay: bool, verdict: Verdict, *, restart: bool
) -> tuple[StreamState, SeqDecision]:
    if seq == 0:
        return _applied(state, seq, now), SeqDecision(verdict, apply=True, drop_entries=restart)
    if may_replay:
        return state, SeqDecision(verdict, apply=False, drop_entries=restart, replay_from=0)
    decision = SeqDecision(verdict, apply=True, drop_entries=True, missed=(0, seq - 1))
    return _applied(state, seq, now), decision


def _replayed(state: StreamState, seq: int, now: float) -> tuple[StreamState, SeqDecision]:
    expected = 0 if state.expected is None else state.expected
    verdict = Verdict.FIRST if state.expected is None else Verdict.IN_ORDER
    if seq < expected:
        return state, SeqDecision(Verdict.DUPLICATE, apply=False)
    if seq == expected:
        return _applied(state, seq, now), SeqDecision(verdict, apply=True)
    decision = SeqDecision(Verdict.GAP, apply=True, drop_entries=True, missed=(expected, seq - 1))
    return _applied(state, seq, now), decision


def _applied(state: StreamState, seq: int, now: float) -> StreamState:
    return replace(state, expected=seq + 1, unconfirmed_since=None)


def replay_failed(state: StreamState, now: float, retry_after_s: float) -> StreamState:
    """A replay went unanswered or broke off: ask for none before `retry_after_s` has passed
    (the message that triggered it is then fed again as replayed, which gives the gap up)."""
    return replace(state, replay_blocked_until=now + retry_after_s)


def reset(state: StreamState) -> StreamState:
    """The engine's entries were dropped from outside (hygiene): the next message starts over
    (replayed from the start of the publisher's buffer when it can be)."""
    return StreamState(live_high=state.live_high, replay_blocked_until=state.replay_blocked_until)


def note_placed(state: StreamState, now: float) -> StreamState:
    """Narwhal placed a prefill that should store new blocks on this engine."""
    if state.unconfirmed_since is not None:
        return state
    return replace(state, unconfirmed_since=now)


def is_stale(state: StreamState, now: float, stale_after_s: float) -> bool:
    """Work placed there `stale_after_s` ago has produced no batch: the stream is not to be
    trusted until one arrives (the engine goes on the approximate index meanwhile)."""
    return state.unconfirmed_since is not None and now - state.unconfirmed_since >= stale_after_s
