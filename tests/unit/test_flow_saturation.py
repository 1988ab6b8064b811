"""When an engine is full and when a role has room (flow/saturation.py): a table."""

from __future__ import annotations

import pytest

from narwhal.config import FlowConfig
from narwhal.fleet.state import Candidate
from narwhal.flow.saturation import (
    EngineView,
    FlowLimits,
    Full,
    below_limits,
    can_start,
    engine_full,
    full_reason,
    role_has_room,
)
from narwhal.placement.load import EngineLoad

LIMITS = FlowLimits(engine_waiting_max=8, engine_kv_usage_max=0.95)


@pytest.mark.parametrize(
    ("view", "reason"),
    [
        (EngineView("e", 0), None),
        (EngineView("e", 10_000), None),  # no max_concurrency: Narwhal's count alone never fills
        (EngineView("e", 3, max_concurrency=4), None),
        (EngineView("e", 4, max_concurrency=4), Full.CONCURRENCY),
        (EngineView("e", 5, max_concurrency=4, waiting=20, kv_usage=1.0), Full.CONCURRENCY),
        (EngineView("e", 0, waiting=8), None),  # at the limit: not beyond it
        (EngineView("e", 0, waiting=9), Full.WAITING),
        (EngineView("e", 0, waiting=9, kv_usage=0.99), Full.WAITING),
        (EngineView("e", 0, kv_usage=0.95), None),
        (EngineView("e", 0, kv_usage=0.951), Full.KV_USAGE),
    ],
)
def test_full_reason(view: EngineView, reason: Full | None) -> None:
    assert full_reason(view, LIMITS) is reason
    assert engine_full(view, LIMITS) is (reason is not None)


def test_a_stale_or_missing_scrape_says_nothing() -> None:
    busy = EngineLoad(waiting=50, running=4, kv_usage=0.99, at=100.0)
    fresh = EngineView.of("e", 1, None, busy, now=104.0, stale_s=5.0)
    assert full_reason(fresh, LIMITS) is Full.WAITING
    stale = EngineView.of("e", 1, None, busy, now=105.5, stale_s=5.0)
    assert (stale.waiting, stale.kv_usage) == (None, None) and not engine_full(stale, LIMITS)
    assert EngineView.of("e", 2, 2, None, 0.0, 5.0) == EngineView("e", 2, 2)


def test_a_role_has_room_while_one_engine_has() -> None:
    full = EngineView("a", 4, max_concurrency=4)
    room = EngineView("b", 0, kv_usage=0.5)
    assert role_has_room([full, room], LIMITS)
    assert not role_has_room([full], LIMITS)
    assert not role_has_room([], LIMITS)  # none eligible: no capacity, not a wait


def test_a_request_starts_only_when_both_roles_have_room() -> None:
    room, full = EngineView("p", 0), EngineView("d", 1, max_concurrency=1)
    assert can_start([room], [room], LIMITS)
    assert not can_start([room], [full], LIMITS)  # never holds prefill KV while decode is full
    assert not can_start([full], [room], LIMITS)


def test_limits_of_the_config() -> None:
    flow = FlowConfig(engine_waiting_max=2, engine_kv_usage_max=0.5)
    assert FlowLimits.of(flow) == FlowLimits(2, 0.5)
    assert FlowLimits.of(FlowConfig()) == LIMITS


def test_with_flow_off_a_full_engine_is_never_placed_on_and_a_full_role_has_no_room() -> None:
    """`below_limits`: an engine at its max_concurrency is dropped; the role has room while
    one left is not full by its fresh scrape either (one full by its scrape alone stays a
    candidate beside it)."""
    limits = FlowLimits.of(FlowConfig())
    caps = {"a": 1, "b": None, "c": None}
    queued = {"b": EngineLoad(waiting=9, running=4, kv_usage=0.1, at=0.0)}
    engines = [Candidate("a", 1), Candidate("b", 3), Candidate("c", 0)]
    below, room = below_limits(engines, caps.get, queued, 0.0, 5.0, limits)
    assert [c.id for c in below] == ["b", "c"] and room
    below, room = below_limits(engines[:2], caps.get, queued, 0.0, 5.0, limits)
    assert [c.id for c in below] == ["b"] and not room  # b is past engine_waiting_max
    assert below_limits(engines[:2], caps.get, queued, 10.0, 5.0, limits)[1]  # stale: room
