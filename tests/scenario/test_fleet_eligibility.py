"""Who may receive new work, on a fake clock (spec "Last-engine protection", "Failure
quarantine", DESIGN §2).

Ejected engines and hard holds never are candidates; soft holds (performance drift, failure
quarantine) never remove the last eligible engine of a role; an expired temporary hold stops
counting at its deadline through `candidates()` alone; a confirmed failure removes even the
last engine and `/ready` then reports the missing role.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from narwhal.clock import FakeClock
from narwhal.config import Config, Role, parse_config
from narwhal.control.lifecycle import Lifecycle
from narwhal.engine.failures import FailureClass
from narwhal.fleet.events import LegFailed, LivenessSwept
from narwhal.fleet.holds import SOFT_HOLDS, HoldName
from narwhal.fleet.readiness import ready_reason
from narwhal.fleet.reducer import Policy
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.server import Router
from narwhal.telemetry.fleet_metrics import watch_fleet
from narwhal.telemetry.metrics import Metrics
from tests.support.fleet import verify_all
from tests.support.served import serve_http

HARD_HOLDS = (
    HoldName.OPERATOR_DRAIN,
    HoldName.PLANNED_MAINTENANCE,
    HoldName.INFERENCE_VERIFICATION,
)
SOFT = (HoldName.PERFORMANCE_DRIFT, HoldName.FAILURE_QUARANTINE)


def config(prefill: int = 2, decode: int = 2, both: int = 0, **recovery: Any) -> Config:
    engines = []
    port = 9000
    for role, count, prefix in (
        ("prefill", prefill, "p"),
        ("decode", decode, "d"),
        ("both", both, "b"),
    ):
        for i in range(count):
            port += 1
            engines.append({"id": f"{prefix}{i}", "url": f"http://127.0.0.1:{port}", "role": role})
    return parse_config({"model": "demo-model", "engines": engines, "recovery": recovery})


@dataclass
class World:
    cfg: Config
    clock: FakeClock
    fleet: Fleet
    lifecycle: Lifecycle
    metrics: Metrics

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def e(self, engine_id: str) -> EngineState:
        return self.fleet.get(engine_id)

    def ids(self, role: Role) -> list[str]:
        return sorted(c.id for c in self.fleet.candidates(role, self.now))


def world(cfg: Config | None = None) -> World:
    cfg = cfg or config()
    clock = FakeClock()
    fleet = verify_all(Fleet(cfg.engines, clock, Policy.of(cfg.recovery)))  # already serving
    metrics = Metrics()
    watch_fleet(fleet, metrics, clock)
    return World(cfg, clock, fleet, Lifecycle(fleet), metrics)


def test_soft_and_hard_hold_sets_are_the_spec_ones() -> None:
    assert frozenset(SOFT) == SOFT_HOLDS
    assert set(HARD_HOLDS) | set(SOFT) == set(HoldName)


def test_all_engines_are_candidates_at_start() -> None:
    w = world()
    assert w.ids(Role.PREFILL) == ["p0", "p1"]
    assert w.ids(Role.DECODE) == ["d0", "d1"]


# --------------------------------------------------------------------------- never candidates
def test_ejected_engine_is_never_a_candidate() -> None:
    w = world()
    w.lifecycle.eject(w.e("p0"), "connection", "refused", w.now)
    assert w.ids(Role.PREFILL) == ["p1"]
    assert w.ids(Role.DECODE) == ["d0", "d1"]
    assert not w.fleet.eligible(w.e("p0"), w.now)


@pytest.mark.parametrize("hold", HARD_HOLDS)
@pytest.mark.parametrize("peer", [True, False], ids=["with-peer", "last-engine"])
def test_hard_holds_are_never_candidates(hold: HoldName, peer: bool) -> None:
    w = world(config(prefill=2 if peer else 1, decode=1))
    w.lifecycle.hold(w.e("p0"), hold, "test", w.now)
    assert w.ids(Role.PREFILL) == (["p1"] if peer else [])


@pytest.mark.parametrize("hard", HARD_HOLDS)
@pytest.mark.parametrize("soft", SOFT)
def test_a_hard_hold_wins_over_a_soft_hold_on_the_last_engine(
    hard: HoldName, soft: HoldName
) -> None:
    w = world(config(prefill=1, decode=1))
    w.lifecycle.hold(w.e("p0"), soft, "test", w.now)
    w.lifecycle.hold(w.e("p0"), hard, "test", w.now)
    assert w.ids(Role.PREFILL) == []


def test_hard_hold_on_a_both_engine_removes_it_from_both_roles() -> None:
    w = world(config(prefill=0, decode=0, both=2))
    w.lifecycle.hold(w.e("b0"), HoldName.OPERATOR_DRAIN, "test", w.now)
    assert w.ids(Role.PREFILL) == ["b1"]
    assert w.ids(Role.DECODE) == ["b1"]
    assert w.ids(Role.BOTH) == ["b1"]


# --------------------------------------------------------------------------- soft holds
@pytest.mark.parametrize("hold", SOFT)
def test_soft_hold_removes_an_engine_when_a_peer_remains(hold: HoldName) -> None:
    w = world()
    w.lifecycle.hold(w.e("p0"), hold, "test", w.now)
    assert w.ids(Role.PREFILL) == ["p1"]
    assert not w.fleet.eligible(w.e("p0"), w.now)


@pytest.mark.parametrize("hold", SOFT)
def test_soft_hold_never_removes_the_last_engine(hold: HoldName) -> None:
    w = world(config(prefill=1, decode=1))
    w.lifecycle.hold(w.e("p0"), hold, "test", w.now)
    assert w.ids(Role.PREFILL) == ["p0"]
    assert w.fleet.eligible(w.e("p0"), w.now)


@pytest.mark.parametrize("hold", SOFT)
def test_soft_hold_keeps_the_last_engine_when_its_peers_are_gone(hold: HoldName) -> None:
    w = world(config(prefill=3, decode=1))
    w.lifecycle.hold(w.e("p0"), hold, "test", w.now)
    assert w.ids(Role.PREFILL) == ["p1", "p2"]
    w.lifecycle.eject(w.e("p1"), "connection", "refused", w.now)
    assert w.ids(Role.PREFILL) == ["p2"]
    w.lifecycle.hold(w.e("p2"), HoldName.OPERATOR_DRAIN, "operator", w.now)
    # p0 is now the last eligible prefill engine: the soft hold no longer removes it
    assert w.ids(Role.PREFILL) == ["p0"]
    # and once a peer is back, the soft hold takes effect again
    w.lifecycle.release(w.e("p2"), HoldName.OPERATOR_DRAIN, "operator", w.now)
    assert w.ids(Role.PREFILL) == ["p2"]


def test_soft_holds_on_every_engine_keep_the_role_served() -> None:
    w = world()
    w.lifecycle.hold(w.e("p0"), HoldName.PERFORMANCE_DRIFT, "slow", w.now)
    w.lifecycle.hold(w.e("p1"), HoldName.FAILURE_QUARANTINE, "failed", w.now, duration_s=30)
    assert w.ids(Role.PREFILL) != []
    assert w.ids(Role.DECODE) == ["d0", "d1"]


def test_soft_hold_protection_is_per_role() -> None:
    w = world(config(prefill=1, decode=2))
    w.lifecycle.hold(w.e("p0"), HoldName.PERFORMANCE_DRIFT, "slow", w.now)
    w.lifecycle.hold(w.e("d0"), HoldName.PERFORMANCE_DRIFT, "slow", w.now)
    assert w.ids(Role.PREFILL) == ["p0"]  # last prefill: kept
    assert w.ids(Role.DECODE) == ["d1"]  # a decode peer remains: removed


def test_a_both_engine_is_the_peer_that_lets_a_soft_hold_apply() -> None:
    w = world(config(prefill=1, decode=1, both=1))
    w.lifecycle.hold(w.e("p0"), HoldName.PERFORMANCE_DRIFT, "slow", w.now)
    assert w.ids(Role.PREFILL) == ["b0"]
    assert w.ids(Role.DECODE) == ["b0", "d0"]


# --------------------------------------------------------------------------- deadlines
@pytest.mark.parametrize("hold", [*SOFT, *HARD_HOLDS])
def test_an_expired_temporary_hold_stops_counting_at_its_deadline(hold: HoldName) -> None:
    w = world()
    w.lifecycle.hold(w.e("p0"), hold, "test", w.now, duration_s=30.0)
    deadline = w.e("p0").holds[hold].deadline_mono
    assert deadline == w.now + 30.0
    assert w.ids(Role.PREFILL) == ["p1"]
    w.clock.advance(29.5)
    assert w.ids(Role.PREFILL) == ["p1"]
    w.clock.advance(0.5)
    assert w.now == deadline
    # no monitor pass, no expire_holds: selection alone ignores the expired hold
    assert w.ids(Role.PREFILL) == ["p0", "p1"]
    assert hold in w.e("p0").holds  # the record is still there; only selection moved on
    assert w.fleet.eligible(w.e("p0"), w.now)


def test_candidates_never_mutate() -> None:
    w = world()
    w.lifecycle.hold(w.e("p0"), HoldName.FAILURE_QUARANTINE, "q", w.now, duration_s=5.0)
    w.clock.advance(10)
    before = dict(w.e("p0").holds)
    w.fleet.candidates(Role.PREFILL, w.now)
    w.fleet.eligible(w.e("p0"), w.now)
    assert w.e("p0").holds == before


def test_holds_active_counts_a_hold_until_its_deadline_and_not_after() -> None:
    """`narwhal_holds_active` is read at scrape time: an expired hold stops counting at its
    deadline with no monitor pass, like candidate selection; a permanent one keeps counting."""
    w = world()

    def gauge(name: HoldName) -> float | None:
        return w.metrics.registry.get_sample_value(
            "narwhal_holds_active", {"engine": "p0", "hold": name.value}
        )

    assert {name: gauge(name) for name in HoldName} == {name: 0 for name in HoldName}
    w.lifecycle.hold(w.e("p0"), HoldName.FAILURE_QUARANTINE, "q", w.now, duration_s=30.0)
    w.lifecycle.hold(w.e("p0"), HoldName.OPERATOR_DRAIN, "operator", w.now)
    assert gauge(HoldName.FAILURE_QUARANTINE) == 1 and gauge(HoldName.OPERATOR_DRAIN) == 1
    w.clock.advance(29.9)
    assert gauge(HoldName.FAILURE_QUARANTINE) == 1
    w.clock.advance(0.1)
    assert HoldName.FAILURE_QUARANTINE in w.e("p0").holds  # not removed yet, no longer active
    assert gauge(HoldName.FAILURE_QUARANTINE) == 0
    assert gauge(HoldName.OPERATOR_DRAIN) == 1
    w.lifecycle.release(w.e("p0"), HoldName.OPERATOR_DRAIN, "operator", w.now)
    assert gauge(HoldName.OPERATOR_DRAIN) == 0
    assert (
        w.metrics.registry.get_sample_value(
            "narwhal_holds_active", {"engine": "p1", "hold": "operator_drain"}
        )
        == 0
    )


def test_a_permanent_hold_never_expires() -> None:
    w = world()
    w.lifecycle.hold(w.e("p0"), HoldName.OPERATOR_DRAIN, "operator", w.now)
    w.clock.advance(10**7)
    assert w.ids(Role.PREFILL) == ["p1"]


# --------------------------------------------------------------------------- confirmed failure
@pytest.mark.parametrize(("victim", "role"), [("p0", "prefill"), ("d0", "decode")])
def test_a_confirmed_failure_removes_even_the_last_engine(victim: str, role: str) -> None:
    cfg = config(prefill=1, decode=1)
    clock = FakeClock()
    router = Router(cfg, clock=clock)
    verify_all(router.fleet)
    assert router.ready() is None
    engine = router.fleet.get(victim)
    router.lifecycle.eject(engine, FailureClass.CONNECTION.value, "refused", clock.monotonic())
    assert router.fleet.candidates(Role(role), clock.monotonic()) == []
    assert router.ready() == f"no capacity: {role}"
    assert ready_reason(None, None, [Role(role)]) == f"no capacity: {role}"
    assert router.metrics.registry.get_sample_value("narwhal_ready") == 0


def test_ejecting_both_last_engines_reports_prefill_first() -> None:
    cfg = config(prefill=1, decode=1)
    clock = FakeClock()
    router = Router(cfg, clock=clock)
    verify_all(router.fleet)
    for engine_id in ("d0", "p0"):
        router.lifecycle.eject(router.fleet.get(engine_id), "liveness", "silent", clock.monotonic())
    assert router.ready() == "no capacity: prefill"


def test_a_confirmed_failure_on_a_drift_held_last_engine_removes_it() -> None:
    cfg = config(prefill=1, decode=1)
    clock = FakeClock()
    router = Router(cfg, clock=clock)
    verify_all(router.fleet)
    router.lifecycle.hold(
        router.fleet.get("p0"), HoldName.PERFORMANCE_DRIFT, "slow", clock.monotonic()
    )
    assert router.ready() is None  # protected
    router.lifecycle.eject(router.fleet.get("p0"), "connection", "refused", clock.monotonic())
    assert router.ready() == "no capacity: prefill"


@asynccontextmanager
async def http_without(tmp_path: Path, *ejected: str) -> AsyncIterator[aiohttp.ClientSession]:
    """A router on a loopback socket whose engines `ejected` were taken out."""
    cfg = parse_config(
        {
            "model": "demo-model",
            "engines": [
                {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
                {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode"},
            ],
            "handoff": {"path": str(tmp_path / "handoff.json")},
        }
    )
    clock = FakeClock()
    router = Router(cfg, clock=clock)
    verify_all(router.fleet)
    for engine_id in ejected:
        router.lifecycle.eject(
            router.fleet.get(engine_id), "connection", "refused", clock.monotonic()
        )
    await router.client.start()
    try:
        async with serve_http(router) as http:
            yield http
    finally:
        await router.client.close()


@pytest.mark.parametrize(
    ("ejected", "role"),
    [
        (("p0",), "prefill"),
        (("d0",), "decode"),
        (("p0", "d0"), "prefill"),
        (("d0", "p0"), "prefill"),
    ],
)
async def test_exhausted_capacity_is_the_same_503_on_ready_and_completions(
    tmp_path: Path, ejected: tuple[str, ...], role: str
) -> None:
    """Completions name the missing role by /ready's precedence (prefill before decode)."""
    async with http_without(tmp_path, *ejected) as http:
        resp = await http.get("/ready")
        assert (resp.status, await resp.text()) == (503, f"no capacity: {role}")
        resp = await http.post(
            "/v1/completions", json={"model": "demo-model", "prompt": "hi", "max_tokens": 2}
        )
        assert resp.status == 503
        body = await resp.json()
        assert set(body) == {"error"}
        assert body["error"]["message"] == f"no capacity: {role}"
        assert body["error"]["code"] == 503


# --------------------------------------------------------------------------- clearing holds
def test_health_ok_clears_failure_quarantine_but_never_operator_drain() -> None:
    w = world()
    w.lifecycle.hold(w.e("p0"), HoldName.FAILURE_QUARANTINE, "failed", w.now, duration_s=60)
    w.lifecycle.hold(w.e("p0"), HoldName.OPERATOR_DRAIN, "operator", w.now)
    w.lifecycle.health_ok(w.e("p0"), w.now)
    assert set(w.e("p0").holds) == {HoldName.OPERATOR_DRAIN}
    w.lifecycle.health_ok(w.e("p0"), w.now)
    assert set(w.e("p0").holds) == {HoldName.OPERATOR_DRAIN}
    assert w.ids(Role.PREFILL) == ["p1"]


@pytest.mark.parametrize(
    "hold",
    [
        HoldName.OPERATOR_DRAIN,
        HoldName.PLANNED_MAINTENANCE,
        HoldName.INFERENCE_VERIFICATION,
        HoldName.PERFORMANCE_DRIFT,
    ],
)
def test_health_ok_leaves_every_other_hold(hold: HoldName) -> None:
    w = world()
    w.lifecycle.hold(w.e("p0"), hold, "test", w.now)
    w.lifecycle.health_ok(w.e("p0"), w.now)
    assert set(w.e("p0").holds) == {hold}


def test_health_ok_readmits_a_quarantined_engine_before_its_deadline() -> None:
    w = world()
    w.lifecycle.hold(w.e("p0"), HoldName.FAILURE_QUARANTINE, "failed", w.now, duration_s=60)
    w.clock.advance(1)
    assert w.ids(Role.PREFILL) == ["p1"]
    w.lifecycle.health_ok(w.e("p0"), w.now)
    assert w.ids(Role.PREFILL) == ["p0", "p1"]


def test_readmit_clears_ejection_evidence_and_drains() -> None:
    # eject_after above the streak, so the ejection below is the explicit one
    w = world(config(failure_quarantine_s=30, eject_after=4))
    for cls, times in ((FailureClass.CONNECTION, 3), (FailureClass.TIMEOUT, 1)):
        for _ in range(times):
            w.fleet.apply(LegFailed("p0", cls, "failed", "test"), w.now)
    for _ in range(2):
        w.fleet.apply(LivenessSwept("p0", silent=True), w.now)
    assert w.e("p0").evidence == {FailureClass.CONNECTION: 3, FailureClass.TIMEOUT: 1}
    assert w.e("p0").liveness_misses == 2
    assert w.e("p0").ejected is None
    w.lifecycle.hold(w.e("p0"), HoldName.OPERATOR_DRAIN, "operator", w.now)
    w.lifecycle.hold(w.e("p0"), HoldName.PLANNED_MAINTENANCE, "upgrade", w.now)
    w.lifecycle.hold(w.e("p0"), HoldName.INFERENCE_VERIFICATION, "stream streak", w.now)
    w.lifecycle.eject(w.e("p0"), "connection", "refused", w.now)
    p0 = w.e("p0")
    assert p0.ejected is not None
    assert p0.ejected.evidence == {"connection": 3, "timeout": 1}
    assert HoldName.FAILURE_QUARANTINE in p0.holds
    assert w.ids(Role.PREFILL) == ["p1"]

    # An automatic readmission keeps the operator's drain; only the operator's clears it.
    w.lifecycle.readmit(w.e("p0"), "verified", w.now)
    p0 = w.e("p0")
    assert p0.ejected is None
    assert p0.evidence == {}
    assert p0.liveness_misses == 0
    assert set(p0.holds) == {HoldName.OPERATOR_DRAIN}
    assert w.ids(Role.PREFILL) == ["p1"]

    w.lifecycle.readmit(w.e("p0"), "operator readmission", w.now, operator=True)
    assert w.e("p0").holds == {}
    assert w.ids(Role.PREFILL) == ["p0", "p1"]


# --------------------------------------------------------------------------- failure quarantine
def test_eject_without_quarantine_configured_adds_no_hold() -> None:
    w = world()
    w.lifecycle.eject(w.e("p0"), "connection", "refused", w.now)
    assert w.e("p0").holds == {}


@pytest.mark.parametrize("quarantine_s", [0.5, 30.0, 600.0])
def test_eject_adds_a_failure_quarantine_until_now_plus_quarantine_s(quarantine_s: float) -> None:
    w = world(config(failure_quarantine_s=quarantine_s))
    w.clock.advance(7.0)
    now = w.now
    wall = w.clock.wall()
    w.lifecycle.eject(w.e("p0"), "kv_handoff", "garbage handoff", now)
    hold = w.e("p0").holds[HoldName.FAILURE_QUARANTINE]
    assert hold.deadline_mono == now + quarantine_s
    assert hold.deadline_wall == wall + quarantine_s
    assert hold.since_wall == wall
    assert "kv_handoff" in hold.reason
    assert not hold.expired(now + quarantine_s - 0.25)
    assert hold.expired(now + quarantine_s)


def test_eject_is_idempotent_and_keeps_the_first_quarantine_deadline() -> None:
    w = world(config(failure_quarantine_s=30))
    first = w.now
    w.lifecycle.eject(w.e("p0"), "connection", "refused", first)
    w.clock.advance(10)
    w.lifecycle.eject(w.e("p0"), "connection", "refused again", w.now)
    assert w.e("p0").holds[HoldName.FAILURE_QUARANTINE].deadline_mono == first + 30
    assert w.e("p0").ejected is not None
    assert w.e("p0").ejected.reason == "refused"


# --------------------------------------------------------------------------- ejection record
@pytest.mark.parametrize("cause", [*(c.value for c in FailureClass), "liveness"])
async def test_the_admin_ejection_record_names_the_class(tmp_path: Path, cause: str) -> None:
    """`/admin/engines` shows the ejection with its class (also as `cause`), time, reason and
    the evidence at the moment of ejection."""
    cfg = config(prefill=1, decode=1)
    clock = FakeClock()
    router = Router(cfg, clock=clock)
    verify_all(router.fleet)
    for _ in range(2):  # below eject_after (3): evidence only, no action
        router.fleet.apply(LegFailed("d0", FailureClass.STREAM, "bad", "decode"), clock.monotonic())
    assert router.fleet.get("d0").evidence == {FailureClass.STREAM: 2}
    router.lifecycle.eject(router.fleet.get("d0"), cause, "the reason", clock.monotonic())
    async with serve_http(router) as http:
        resp = await http.get("/admin/engines")
        engines = {e["id"]: e for e in (await resp.json())["engines"]}
    assert engines["p0"]["ejected"] is False and engines["p0"]["ejection"] is None
    assert engines["d0"]["ejected"] is True
    assert engines["d0"]["ejection"] == {
        "class": cause,
        "cause": cause,
        "reason": "the reason",
        "at": clock.wall(),
        "evidence": {"stream": 2},
    }
