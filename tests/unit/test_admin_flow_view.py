"""`/admin/flow` and the queue in `narwhal status`, from plain values (DESIGN §13): depth and
oldest wait by priority, refusals by reason and key, on or off."""

from __future__ import annotations

from dataclasses import replace

from narwhal.cli.operator import flow_lines
from narwhal.telemetry import admin_views as views
from tests.unit.test_admin_views import snapshot as admin_snapshot

REFUSED = {
    "deadline": 0,
    "not_admitted": 0,
    "queue_full": 3,
    "requests_per_minute": 1,
    "tokens_per_minute": 0,
}


def snapshot(**changes: object) -> views.FlowSnapshot:
    base = views.FlowSnapshot(
        enabled=True,
        rate_limits=True,
        queue_limit=64,
        max_wait_s=30.0,
        mono=100.0,
        waiting=((5, 99.5), (0, 98.0), (0, 99.0), (5, 97.5), (0, 99.9)),
        running=2,
        refused=REFUSED,
        refused_by_key={"0123456789ab": {"requests_per_minute": 1}},
        served_tokens={"0123456789ab": 40},
        resuming=1,
        preempted={5: 2},
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_the_queue_by_priority_lowest_first_with_each_oldest_wait() -> None:
    doc = views.flow(snapshot())
    assert doc["waiting"] == 5 and doc["running"] == 2 and doc["queue_limit"] == 64
    assert doc["resuming"] == 1 and doc["preempted"] == {"5": 2}
    assert doc["priorities"] == [
        {"priority": 0, "waiting": 3, "oldest_wait_s": 2.0},
        {"priority": 5, "waiting": 2, "oldest_wait_s": 2.5},
    ]
    assert doc["oldest_wait_s"] == 2.5
    assert doc["enabled"] is True and doc["max_wait_s"] == 30.0


def test_refusals_by_reason_and_rate_limits_by_key() -> None:
    doc = views.flow(snapshot())
    assert doc["refused"] == REFUSED
    assert list(doc["refused"]) == sorted(REFUSED)
    assert doc["refused_by_key"] == {"0123456789ab": {"requests_per_minute": 1}}
    assert doc["served_tokens"] == {"0123456789ab": 40}


def test_an_empty_queue_has_no_oldest_wait() -> None:
    doc = views.flow(snapshot(waiting=(), running=0))
    assert doc["waiting"] == 0 and doc["priorities"] == [] and doc["oldest_wait_s"] is None


def test_a_wait_read_across_a_clock_step_is_never_negative() -> None:
    doc = views.flow(snapshot(waiting=((0, 100.5),)))
    assert doc["priorities"][0]["oldest_wait_s"] == 0.0


def test_the_dashboard_carries_the_flow_document() -> None:
    without = views.dashboard(admin_snapshot())
    assert without["flow"] is None
    with_flow = views.dashboard(replace(admin_snapshot(), flow=snapshot()))
    assert with_flow["flow"] == views.flow(snapshot())


def test_narwhal_status_prints_the_queue_then_each_priority_then_refusals() -> None:
    assert flow_lines(views.flow(snapshot())) == [
        "flow: on, 5 waiting of 64 (oldest 2.5 s), 2 running, 1 stepped aside",
        "  priority 0: 3 waiting, oldest 2.0 s",
        "  priority 5: 2 waiting, oldest 2.5 s",
        "  preempted: priority 5 2",
        "  refused: deadline 0, not_admitted 0, queue_full 3, requests_per_minute 1, "
        "tokens_per_minute 0",
        "  refused key 0123456789ab: requests_per_minute 1",
    ]


def test_narwhal_status_says_when_the_queue_is_off() -> None:
    off = views.flow(snapshot(enabled=False, waiting=(), running=0, refused_by_key={}))
    assert flow_lines(views.flow(snapshot(resuming=0, preempted={})))[0] == (
        "flow: on, 5 waiting of 64 (oldest 2.5 s), 2 running"
    )
    assert flow_lines(off)[0] == "flow: off, rate limits on"
    quiet = views.flow(snapshot(enabled=False, rate_limits=False, waiting=(), refused_by_key={}))
    assert flow_lines(quiet)[0] == "flow: off"
