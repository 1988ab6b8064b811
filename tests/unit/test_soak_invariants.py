"""The soak's invariant checkers on synthetic observations: each counts a violation when there
is one and none when there is not, so `tests/e2e/test_soak.py` asserting zeros can fail."""

from __future__ import annotations

import itertools
import random

import pytest
from bench.soak import invariants as inv
from bench.soak.schedule import ENGINELESS, ROUTER_KILL_GAP_S, plan

ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


def test_hung_counts_give_ups_and_overlong_requests() -> None:
    records = [(0.0, 1.0, "ok", 1, 0), (0.0, 12.0, "hung", 0, 0), (1.0, 13.5, "http_502", 0, 0)]
    assert inv.hung(records, deadline_s=12.0) == 2
    assert inv.hung(records[:1], deadline_s=12.0) == 0


def test_client_error_5xx_counts_5xx_and_no_answer_not_4xx_or_lost_connections() -> None:
    answers = [
        (0.0, "no_prompt", 400, ""),
        (1.0, "prompt_too_long", 502, "upstream failure"),
        (2.0, "x", None, ""),
        (3.0, "y", 0, ""),
    ]
    assert inv.client_error_5xx(answers) == 2
    assert inv.client_error_5xx([(0.0, "no_prompt", 422, "")]) == 0


def test_a_fleet_state_503_excuses_only_what_needs_the_engines_to_judge() -> None:
    closed = "not admitting requests: standby: lease held by router-a"
    assert inv.client_error_5xx([(0.0, "prompt_too_long_stream", 503, closed)]) == 0
    assert inv.client_error_5xx([(0.0, "malformed_json", 503, closed)]) == 1
    assert inv.client_error_5xx([(0.0, "prompt_too_long", 503, "no capacity: prefill")]) == 0
    assert inv.client_error_5xx([(0.0, "no_prompt", 503, "no capacity: prefill")]) == 1
    assert inv.client_error_5xx([(0.0, "prompt_too_long", 503, "server saturated")]) == 1
    assert inv.client_error_5xx([(0.0, "prompt_too_long", 502, "upstream failure")]) == 1


@pytest.mark.parametrize(
    ("status", "is_blocked"),
    [
        ("in-service", False),
        ("ejected", True),
        ("held(operator_drain)", True),
        ("held(planned_maintenance)", True),
        ("held(failure_quarantine)", False),
        ("held(failure_quarantine,performance_drift)", False),
        ("held(failure_quarantine,inference_verification)", True),
        ("unverified", True),
    ],
)
def test_blocked_statuses(status: str, is_blocked: bool) -> None:
    assert inv.blocked(status) is is_blocked


def test_misplaced_counts_a_leg_past_the_tolerance_on_the_placing_routers_view() -> None:
    drained = inv.Transition(10.0, "d0", "held(operator_drain)")
    readmitted = inv.Transition(20.0, "d0", "in-service")
    timelines = {"a": [drained, readmitted], "b": [inv.Transition(5.0, "d0", "in-service")]}
    active = [(0.0, "a"), (30.0, "b")]
    arrivals = {"d0": [9.0, 10.1, 12.0, 21.0, 31.0]}
    found = inv.misplaced(arrivals, timelines, active, tolerance_s=0.25)
    assert [(m.engine, m.at, m.router) for m in found] == [("d0", 12.0, "a")]  # 10.1: in flight
    # the same leg judged on b's view (b placed it) is fine
    assert inv.misplaced({"d0": [12.0]}, timelines, [(0.0, "b")], 0.25) == []


def test_a_legs_request_id_names_the_router_that_placed_it() -> None:
    """/ready polls lag a takeover: a leg whose id a process of b made is judged on b's view,
    whoever the polls last saw answering 200; an id nobody logged falls back to the polls."""
    timelines = {"a": [inv.Transition(10.0, "d0", "ejected")], "b": []}
    active = [(0.0, "a")]
    prefixes = {"narwhal-aaaa": "a", "narwhal-bbbb": "b"}
    arrivals = {"d0": [12.0, 13.0, 14.0]}
    ids = {"d0": ["narwhal-bbbb-7-a1", "narwhal-aaaa-3-a2", "client-id-a1"]}
    found = inv.misplaced(arrivals, timelines, active, 0.25, ids, prefixes)
    assert [(m.at, m.router, m.request_id, m.placed_by) for m in found] == [
        (13.0, "a", "narwhal-aaaa-3-a2", "request id"),
        (14.0, "a", "client-id-a1", "ready"),
    ]


def test_active_changes_follow_the_router_answering_ready_alone() -> None:
    samples = [(0.0, 200, 503), (1.0, None, 503), (2.0, None, 200), (3.0, 200, 200)]
    assert inv.active_changes(samples) == [(0.0, "a"), (2.0, "b")]


def test_handoff_unparseable_counts_garbage_and_a_vanished_file_not_a_moved_directory() -> None:
    polls = [(0.0, "missing"), (1.0, "ok"), (2.0, "away"), (3.0, "ok"), (4.0, "unparseable")]
    assert inv.handoff_unparseable(polls) == 1
    assert inv.handoff_unparseable([(0.0, "ok"), (1.0, "missing")]) == 1


def test_split_brain_counts_polls_with_two_200s() -> None:
    assert inv.split_brain([(0.0, 200, 503), (1.0, 200, 200), (2.0, None, 200)]) == 1


def test_drains_lost_counts_engines_no_longer_drained() -> None:
    assert inv.drains_lost([(0.0, "p0", True), (0.0, "d1", False)]) == 1


def test_growth_flags_fd_or_rss_beyond_the_tolerance() -> None:
    ok = inv.Stint("a", 1, (40, 60), (50_000, 60_000), 30.0)
    fds = inv.Stint("b", 2, (40, 90), (50_000, 50_000), 30.0)
    rss = inv.Stint("a", 3, (40, 40), (50_000, 90_000), 30.0)
    assert inv.growth([ok, fds, rss], fd_tolerance=32, rss_tolerance_kb=24 * 1024) == [fds, rss]


@pytest.mark.parametrize("seed", range(20))
def test_the_schedule_is_seeded_bounded_and_keeps_a_free_engine_per_role(seed: int) -> None:
    events = plan(random.Random(seed), 120.0, ROLES, router_faults=True)
    assert events == plan(random.Random(seed), 120.0, ROLES, router_faults=True)
    assert events and all(e.t > 3.0 and e.end <= 116.0 for e in events)
    kills = [e.t for e in events if e.kind == "router_kill"]
    assert all(b - a >= ROUTER_KILL_GAP_S for a, b in itertools.pairwise(kills))
    for e in events:
        if e.kind in ENGINELESS:
            continue
        overlapping = [
            o for o in events if o.engine is not None and o is not e and o.t < e.end and e.t < o.end
        ]
        assert e.engine not in {o.engine for o in overlapping}
        same_role = {o.engine for o in overlapping if ROLES[o.engine] == ROLES[e.engine]}
        assert not same_role  # two engines per role: the other one stays untouched
    peer = plan(random.Random(seed), 120.0, ROLES, router_faults=False)
    assert not {e.kind for e in peer} & {"router_kill", "handoff_dir", "drain", "maintenance"}
