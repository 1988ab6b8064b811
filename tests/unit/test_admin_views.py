"""The admin documents (`telemetry/admin_views.py`) from plain values: no router, no clock."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from narwhal.cli.operator import placement_line
from narwhal.config import EngineConfig, Role
from narwhal.engine.failures import FailureClass
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.intervals import Window
from narwhal.fleet.state import EngineState
from narwhal.telemetry import admin_views as views

WALL = 1_800_000_000.0


def state(engine_id: str = "p0", **changes: Any) -> EngineState:
    config = EngineConfig(id=engine_id, url=f"http://{engine_id}:8000", role=Role.PREFILL)
    base = EngineState(config=config, role=Role.PREFILL, verified=True, unverified_reason=None)
    return replace(base, **changes)


def row(s: EngineState, **changes: Any) -> views.EngineRow:
    base = views.EngineRow(s, eligible=True, in_flight=0, drain_settled_at=None, readmission=())
    return replace(base, **changes)


def stats(now: float = 100.0, closed: tuple[Window, ...] = ()) -> views.StatsSnapshot:
    return views.StatsSnapshot(
        interval_s=10.0,
        current=Window(started=now - 4.0),
        closed=closed,
        windows_kept=10,
        drift=(("p0", "slow"),),
        drift_mode="report",
        risk={},
        rebalances=(),
    )


def snapshot(*rows: views.EngineRow, lease: dict[str, Any] | None = None) -> views.AdminSnapshot:
    return views.AdminSnapshot(
        router_id="r1",
        ready=None,
        mono=100.0,
        wall=WALL,
        engines=rows,
        stats=stats(),
        monitor={"healthy": True},
        lease=lease,
        timeline=({"t": 1},),
    )


def test_an_engine_shows_its_holds_evidence_and_what_the_fleet_says_of_it() -> None:
    drain = Hold(HoldName.OPERATOR_DRAIN, "upgrade", since_wall=WALL - 5)
    expired = Hold(HoldName.FAILURE_QUARANTINE, "x", since_wall=WALL - 60, deadline_mono=50.0)
    s = state(
        holds={HoldName.OPERATOR_DRAIN: drain, HoldName.FAILURE_QUARANTINE: expired},
        evidence={FailureClass.TIMEOUT: 2},
        generation=7.0,
    )
    doc = views.engine(row(s, eligible=False, in_flight=3, drain_settled_at=WALL - 1), now=100.0)
    assert doc["holds"] == ["operator_drain"]  # the quarantine ended at 50 (monotonic)
    assert doc["hold_details"] == [
        {"name": "operator_drain", "reason": "upgrade", "since": WALL - 5, "deadline": None}
    ]
    assert doc["evidence"]["timeout"] == 2 and set(doc["evidence"]) == {
        c.value for c in FailureClass
    }
    assert (doc["eligible"], doc["in_flight"], doc["generation"]) == (False, 3, 7.0)
    assert (doc["drain_settled"], doc["drain_settled_at"]) == (True, WALL - 1)
    assert (doc["id"], doc["url"], doc["role"], doc["ejected"]) == (
        "p0",
        "http://p0:8000",
        "prefill",
        False,
    )


def test_the_engines_document_lists_every_engine_in_order() -> None:
    snap = snapshot(row(state("p0")), row(state("d0")))
    doc = views.engines_document(snap)
    assert [e["id"] for e in doc["engines"]] == ["p0", "d0"]
    assert doc["consolidation_risk"] == {}


def test_the_history_has_wall_clock_bounds_each_window_ending_where_the_next_starts() -> None:
    closed = (Window(started=76.0), Window(started=86.0))
    history = views.engine_history(stats(100.0, closed), mono=100.0, wall=WALL)
    bounds = [(w["started"] - WALL, w["ended"] - WALL, w["open"]) for w in history["windows"]]
    assert bounds == [(-24.0, -14.0, False), (-14.0, -4.0, False), (-4.0, 0.0, True)]
    assert (history["interval_s"], history["windows_kept"]) == (10.0, 10)


def test_stats_name_the_drift_and_keep_monotonic_starts() -> None:
    w = Window(started=86.0)
    w.engine("p0").requests = 5
    doc = views.stats(stats(100.0, (w,)))
    assert doc["closed"] == [{"started": 86.0, "engines": {"p0": w.engines["p0"].to_json()}}]
    assert doc["current"] == {}
    assert doc["drift"] == [{"engine": "p0", "reason": "slow"}]


def test_without_a_lease_backend_the_router_is_active_and_with_one_it_says_its_own() -> None:
    alone = snapshot()
    assert views.lease(alone.lease, alone.router_id, with_router_id=True) == {
        "backend": "none",
        "role": "active",
        "router_id": "r1",
    }
    assert views.dashboard(alone)["lease"] == {"backend": "none", "role": "active"}
    held = snapshot(lease={"backend": "etcd", "role": "standby"})
    assert views.lease(held.lease, held.router_id, with_router_id=True) == {
        "backend": "etcd",
        "role": "standby",
    }


def test_the_dashboard_is_one_document_of_the_snapshot() -> None:
    doc = views.dashboard(snapshot(row(state())))
    assert (doc["router_id"], doc["ready"], doc["now"]) == ("r1", None, WALL)
    assert [e["id"] for e in doc["engines"]] == ["p0"]
    assert doc["timeline"] == [{"t": 1}] and doc["monitor"] == {"healthy": True}
    assert doc["engine_history"]["windows"][-1]["open"] is True


def test_handoff_and_workers() -> None:
    assert views.handoff("/h.json", 3, None, (False, "stale", "too_old"))["resume"] == {
        "applied": False,
        "reason": "stale",
        "code": "too_old",
    }
    assert views.handoff("/h.json", 0, None, None)["resume"] is None
    assert views.workers(None, 42, None) == {
        "workers": [{"index": 0, "pid": 42, "running": True}],
        "control": None,
    }
    assert views.workers([{"index": 0}], 42, 9)["control"] == {"pid": 42, "snapshot_version": 9}


def test_placement_shows_each_model_s_hit_rate_and_each_engine_s_blocks() -> None:
    p = views.PlacementSnapshot(
        policy="prefix",
        cached_blocks={"p0": 120, "p1": 0},
        lookup_tokens={"m": 1000.0, "idle": 0.0},
        hit_tokens={"m": 930.0},
        engine_lookup_tokens={"p0": 800.0, "p1": 200.0},
        engine_hit_tokens={"p0": 780.0, "p1": 150.0},
    )
    doc = views.placement(p)
    assert doc["policy"] == "prefix" and doc["cached_blocks"] == {"p0": 120, "p1": 0}
    assert doc["models"]["m"] == {"lookup_tokens": 1000.0, "hit_tokens": 930.0, "hit_rate": 0.93}
    assert doc["models"]["idle"]["hit_rate"] is None
    assert doc["engines"]["p0"]["hit_rate"] == 780.0 / 800.0
    assert doc["engines"]["p1"] == {"lookup_tokens": 200.0, "hit_tokens": 150.0, "hit_rate": 0.75}
    snap = replace(snapshot(row(state())), placement=p)
    assert views.engines_document(snap)["placement"] == doc
    assert views.dashboard(snap)["placement"] == doc
    assert "placement" not in views.engines_document(snapshot())


def test_narwhal_status_prints_the_placement_in_one_line() -> None:
    line = placement_line(
        {
            "policy": "prefix",
            "cached_blocks": {"p0": 120, "p1": 80},
            "models": {"m": {"lookup_tokens": 10000.0, "hit_tokens": 9310.0, "hit_rate": 0.931}},
            "engines": {
                "p0": {"lookup_tokens": 6000.0, "hit_tokens": 5700.0, "hit_rate": 0.95},
                "p1": {"lookup_tokens": 0.0, "hit_tokens": 0.0, "hit_rate": None},
            },
        }
    )
    assert line == (
        "placement: prefix; m hit rate 93.1% (9,310 of 10,000 prompt tokens); "
        "hit rate by prefill engine p0 95.0%, p1 -; cached blocks p0 120, p1 80"
    )
    assert placement_line({"policy": "least_loaded", "cached_blocks": {}, "models": {}}) == (
        "placement: least_loaded"
    )
