"""The controller stage on a fake clock (DESIGN §2 last-engine protection, §3 controller stage).

A `Router` that is never started (no sockets, no monitor loop): the test fills `router.stats`
with latency samples, closes windows with `router.stats.rollover`, and calls
`router.small.controller(now)` (and `telemetry(now)`) itself. Covered: the `performance_drift`
hold in enforce mode and its deadline, detect mode, last-engine protection through
`Fleet.candidates`, expiry, consolidation risk (the busiest share from the last closed
interval), and `kv_both` role rebalancing with a fake `verify_role`: "too little" capacity,
"idle enough", verification in the background (failing, raising, passing; the pass never waits
for it), the re-check by id and role, and the role persisted in the handoff.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from narwhal.clock import FakeClock
from narwhal.config import ConfigError, Role, parse_config
from narwhal.control.stages import SmallStages, consolidation_risk, rebalance_candidate
from narwhal.fleet.holds import HoldName
from narwhal.fleet.state import EngineState
from narwhal.server import Router
from narwhal.state.resume import resume
from tests.support.fleet import set_in_flight, verify_all
from tests.support.poll import eventually
from tests.support.router import router_config
from tests.support.served import serve_http

INTERVAL_S = 10.0
HOLD_S = 60.0
FAST = 0.010
SLOW = 0.100
CONTROLLER = {
    "interval_s": INTERVAL_S,
    "drift_mode": "enforce",
    "drift_factor": 3.0,
    "drift_min_samples": 5,
    "drift_intervals": 2,
    "drift_hold_s": HOLD_S,
}
PD_FLEET = [
    {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
    {"id": "p1", "url": "http://127.0.0.1:2", "role": "prefill"},
    {"id": "p2", "url": "http://127.0.0.1:3", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:4", "role": "decode"},
    {"id": "d1", "url": "http://127.0.0.1:5", "role": "decode"},
]
SLOW_P2 = {"p0": FAST, "p1": FAST, "p2": SLOW, "d0": FAST, "d1": FAST}


@dataclass
class Rig:
    router: Router
    clock: FakeClock

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def interval(self, latencies: Mapping[str, float], samples: int = 10) -> None:
        """One interval of traffic: `samples` latencies per engine, then the window closes."""
        for engine_id, seconds in latencies.items():
            for _ in range(samples):
                self.router.stats.request(engine_id)
                self.router.stats.latency(engine_id, seconds)
        self.clock.advance(INTERVAL_S)
        assert self.router.stats.rollover(self.now) is not None

    async def controller(self) -> None:
        await self.router.small.controller(self.now)

    def engine(self, engine_id: str) -> EngineState:
        return self.router.fleet.get(engine_id)

    def candidates(self, role: Role) -> set[str]:
        return {c.id for c in self.router.fleet.candidates(role, self.now)}

    def metric(self, name: str, **labels: str) -> float | None:
        return self.router.metrics.registry.get_sample_value(name, labels)

    def eject(self, engine_id: str) -> None:
        self.router.lifecycle.eject(self.engine(engine_id), "connection", "test ejection", self.now)


def make_rig(tmp_path: Path, engines: list[dict[str, Any]] = PD_FLEET, **controller: Any) -> Rig:
    clock = FakeClock()
    config = parse_config(router_config(engines, tmp_path, controller={**CONTROLLER, **controller}))
    Path(config.handoff.path).parent.mkdir(parents=True, exist_ok=True)
    router = Router(config, clock=clock)
    verify_all(router.fleet)  # a serving fleet, already seen healthy
    return Rig(router, clock)


def handoff_document(rig: Rig) -> Any:
    return json.loads(Path(rig.router.config.handoff.path).read_text())


def drift_hold(engine: EngineState) -> Any:
    return engine.holds.get(HoldName.PERFORMANCE_DRIFT)


# --------------------------------------------------------------------------- enforce / detect
async def test_enforce_holds_the_drifting_engine_until_now_plus_drift_hold_s(
    tmp_path: Path,
) -> None:
    rig = make_rig(tmp_path)
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    now, wall = rig.now, rig.clock.wall()
    await rig.controller()

    hold = drift_hold(rig.engine("p2"))
    assert hold is not None
    assert hold.deadline_mono == pytest.approx(now + HOLD_S)
    assert hold.deadline_wall == pytest.approx(wall + HOLD_S)
    assert "peers' median" in hold.reason
    assert [d.engine_id for d in rig.router.small.drift] == ["p2"]
    for other in ("p0", "p1", "d0", "d1"):
        assert rig.engine(other).holds == {}
    assert rig.candidates(Role.PREFILL) == {"p0", "p1"}
    assert not rig.router.fleet.eligible(rig.engine("p2"), now)
    assert rig.metric("narwhal_performance_drift_detected_total", engine="p2") == 1
    assert rig.metric("narwhal_holds_active", engine="p2", hold="performance_drift") == 1
    assert rig.metric("narwhal_eligible_engines", role="prefill") == 2


async def test_no_hold_before_n_drifting_intervals(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.interval(SLOW_P2)
    await rig.controller()
    assert drift_hold(rig.engine("p2")) is None
    assert rig.router.small.drift == []
    rig.interval(SLOW_P2)
    await rig.controller()
    assert drift_hold(rig.engine("p2")) is not None


async def test_no_hold_below_the_sample_minimum(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, drift_min_samples=20)
    rig.interval(SLOW_P2, samples=19)
    rig.interval(SLOW_P2, samples=19)
    await rig.controller()
    assert drift_hold(rig.engine("p2")) is None
    assert rig.router.small.drift == []


async def test_detect_mode_records_the_drift_but_applies_no_hold(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, drift_mode="detect")
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    await rig.controller()
    assert [d.engine_id for d in rig.router.small.drift] == ["p2"]
    assert "peers' median" in rig.router.small.drift[0].reason
    assert all(e.holds == {} for e in rig.router.fleet)
    assert rig.candidates(Role.PREFILL) == {"p0", "p1", "p2"}
    assert rig.metric("narwhal_performance_drift_detected_total", engine="p2") == 1


async def test_off_mode_neither_records_nor_holds(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, drift_mode="off")
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    await rig.controller()
    assert rig.router.small.drift == []
    assert all(e.holds == {} for e in rig.router.fleet)
    assert rig.metric("narwhal_performance_drift_detected_total", engine="p2") is None


async def test_drift_is_decided_once_per_closed_interval(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, drift_mode="detect")
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    for _ in range(3):  # several passes within one interval
        await rig.controller()
        rig.clock.advance(1.0)
    assert rig.metric("narwhal_performance_drift_detected_total", engine="p2") == 1
    rig.interval(SLOW_P2)
    await rig.controller()
    assert rig.metric("narwhal_performance_drift_detected_total", engine="p2") == 2


async def test_an_existing_hold_is_not_extended_by_later_intervals(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    await rig.controller()
    first = drift_hold(rig.engine("p2"))
    rig.interval(SLOW_P2)
    await rig.controller()
    assert drift_hold(rig.engine("p2")) == first


async def test_roles_are_compared_separately(tmp_path: Path) -> None:
    # Decode legs are slower than prefill legs by nature; no decode engine may be held for it.
    rig = make_rig(tmp_path)
    latencies = {"p0": FAST, "p1": FAST, "p2": FAST, "d0": 1.0, "d1": 1.0}
    rig.interval(latencies)
    rig.interval(latencies)
    await rig.controller()
    assert rig.router.small.drift == []
    assert all(e.holds == {} for e in rig.router.fleet)


async def test_a_unified_engine_drifting_is_reported_once_per_interval(tmp_path: Path) -> None:
    unified = [
        {"id": f"u{i}", "url": f"http://127.0.0.1:{i + 1}", "role": "both"} for i in range(3)
    ]
    rig = make_rig(tmp_path, engines=unified, drift_mode="detect")
    latencies = {"u0": FAST, "u1": FAST, "u2": SLOW}
    rig.interval(latencies)
    rig.interval(latencies)
    await rig.controller()
    assert [d.engine_id for d in rig.router.small.drift] == ["u2"]
    assert rig.metric("narwhal_performance_drift_detected_total", engine="u2") == 1


async def test_drift_intervals_above_ten_still_detects(tmp_path: Path) -> None:
    try:
        rig = make_rig(tmp_path, drift_intervals=11)
    except ConfigError:
        return  # refusing the key with a clear error is an acceptable answer too
    for _ in range(14):
        rig.interval(SLOW_P2)
    await rig.controller()
    assert drift_hold(rig.engine("p2")) is not None


# --------------------------------------------------------------------------- last-engine protection
async def test_last_engine_protection_when_the_peers_are_ejected_first(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    rig.eject("p0")
    rig.eject("p1")
    await rig.controller()
    # The hold is applied (and visible), but p2 is the last prefill engine: it keeps serving.
    assert drift_hold(rig.engine("p2")) is not None
    assert rig.candidates(Role.PREFILL) == {"p2"}
    assert rig.router.fleet.eligible(rig.engine("p2"), rig.now)
    assert rig.router.ready() is None
    risk = rig.router.small.risk["prefill"]
    assert risk["eligible"] == 1
    assert risk["high"] is True
    assert rig.metric("narwhal_consolidation_risk_high", role="prefill") == 1


async def test_last_engine_protection_when_the_peers_go_after_the_hold(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    await rig.controller()
    assert rig.candidates(Role.PREFILL) == {"p0", "p1"}
    rig.eject("p0")
    assert rig.candidates(Role.PREFILL) == {"p1"}
    rig.eject("p1")
    assert rig.candidates(Role.PREFILL) == {"p2"}  # the held engine is all that is left
    # A readmitted peer takes over again while the hold lasts.
    rig.router.lifecycle.readmit(rig.engine("p1"), "test", rig.now)
    assert rig.candidates(Role.PREFILL) == {"p1"}


async def test_protection_does_not_override_a_blocking_hold(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    await rig.controller()
    rig.eject("p0")
    rig.router.operator.drain("p1")
    # p1 is drained (blocking) and p0 ejected: p2, held only for drift, still serves.
    assert rig.candidates(Role.PREFILL) == {"p2"}


# --------------------------------------------------------------------------- expiry
async def test_the_hold_clears_when_its_deadline_passes(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    await rig.controller()
    deadline = drift_hold(rig.engine("p2")).deadline_mono

    rig.clock.advance(deadline - rig.now - 0.5)
    await rig.router.small.telemetry(rig.now)
    assert drift_hold(rig.engine("p2")) is not None
    assert rig.candidates(Role.PREFILL) == {"p0", "p1"}
    assert rig.metric("narwhal_holds_active", engine="p2", hold="performance_drift") == 1

    rig.clock.advance(0.5)
    # Selection ignores an expired hold at once, without a monitor pass...
    assert rig.candidates(Role.PREFILL) == {"p0", "p1", "p2"}
    assert rig.router.fleet.eligible(rig.engine("p2"), rig.now)
    assert rig.engine("p2").active_holds(rig.now) == []
    # ...and telemetry drops it from the state and the metrics.
    await rig.router.small.telemetry(rig.now)
    assert drift_hold(rig.engine("p2")) is None
    assert rig.metric("narwhal_holds_active", engine="p2", hold="performance_drift") == 0
    assert rig.metric("narwhal_engine_eligible", engine="p2") == 1


async def test_the_hold_is_persisted_with_its_wall_deadline(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    wall = rig.clock.wall()
    await rig.controller()
    await rig.router.handoff.stage(rig.now)
    doc = handoff_document(rig)
    holds = doc["engines"]["p2"]["holds"]
    assert [h["name"] for h in holds] == ["performance_drift"]
    assert holds[0]["deadline"] == pytest.approx(wall + HOLD_S)


# --------------------------------------------------------------------------- HTTP views
@pytest.fixture
async def http_rig(tmp_path: Path) -> AsyncIterator[tuple[Rig, aiohttp.ClientSession]]:
    rig = make_rig(tmp_path)
    async with serve_http(rig.router) as http:
        yield rig, http


async def test_admin_stats_and_engines_show_drift_and_risk(
    http_rig: tuple[Rig, aiohttp.ClientSession],
) -> None:
    rig, http = http_rig
    rig.interval(SLOW_P2)
    rig.interval(SLOW_P2)
    rig.router.stats.request("p0")  # something in the open window
    await rig.controller()

    resp = await http.get("/admin/stats")
    assert resp.status == 200
    stats = await resp.json()
    assert stats["interval_s"] == INTERVAL_S
    assert stats["drift_mode"] == "enforce"
    assert [d["engine"] for d in stats["drift"]] == ["p2"]
    assert "peers' median" in stats["drift"][0]["reason"]
    assert len(stats["closed"]) == 2
    assert stats["closed"][-1]["engines"]["p2"]["latency_samples"] == 10
    assert stats["current"]["p0"]["requests"] == 1
    assert stats["consolidation_risk"]["prefill"]["eligible"] == 2

    resp = await http.get("/admin/engines")
    assert resp.status == 200
    body = await resp.json()
    p2 = next(e for e in body["engines"] if e["id"] == "p2")
    assert p2["holds"] == ["performance_drift"]
    assert p2["eligible"] is False
    assert body["consolidation_risk"] == {
        "prefill": {"eligible": 2, "busiest_share": pytest.approx(1 / 3), "high": False},
        "decode": {"eligible": 2, "busiest_share": 0.5, "high": False},
    }


# --------------------------------------------------------------------------- consolidation risk
async def test_consolidation_risk_counts_eligible_engines_per_role(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    fleet = rig.router.fleet
    risk = consolidation_risk(fleet, rig.now)
    assert risk["prefill"] == {"eligible": 3, "busiest_share": 0.0, "high": False}
    assert risk["decode"] == {"eligible": 2, "busiest_share": 0.0, "high": False}
    rig.eject("d0")
    assert consolidation_risk(fleet, rig.now)["decode"]["high"] is True
    rig.eject("d1")
    assert consolidation_risk(fleet, rig.now)["decode"] == {
        "eligible": 0,
        "busiest_share": 0.0,
        "high": True,
    }
    await rig.controller()
    assert rig.metric("narwhal_eligible_engines", role="decode") == 0
    assert rig.metric("narwhal_consolidation_risk_high", role="decode") == 1
    assert rig.metric("narwhal_consolidation_risk_high", role="prefill") == 0


def traffic(rig: Rig, requests: Mapping[str, int]) -> None:
    for engine_id, n in requests.items():
        for _ in range(n):
            rig.router.stats.request(engine_id)


async def test_busiest_share_comes_from_the_last_closed_interval(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    traffic(rig, {"p0": 6, "p1": 3, "p2": 1, "d0": 5, "d1": 5})
    set_in_flight(rig.router.fleet, "p1", 7)  # the instantaneous count plays no part
    await rig.controller()
    assert rig.router.small.risk["prefill"]["busiest_share"] == 0.0  # nothing closed yet
    assert rig.metric("narwhal_consolidation_busiest_share", role="prefill") == 0.0

    rig.clock.advance(INTERVAL_S)
    assert rig.router.stats.rollover(rig.now) is not None
    await rig.controller()
    risk = rig.router.small.risk
    assert risk["prefill"]["busiest_share"] == pytest.approx(0.6)
    assert risk["decode"]["busiest_share"] == pytest.approx(0.5)
    assert rig.metric("narwhal_consolidation_busiest_share", role="prefill") == pytest.approx(0.6)
    assert rig.metric("narwhal_consolidation_busiest_share", role="decode") == pytest.approx(0.5)

    # While idle the share keeps describing the last closed interval, not 0.0...
    set_in_flight(rig.router.fleet, "p1", 0)
    await rig.controller()
    assert rig.router.small.risk["prefill"]["busiest_share"] == pytest.approx(0.6)
    # ...until an interval closes with traffic on one engine only.
    traffic(rig, {"p2": 4})
    rig.clock.advance(INTERVAL_S)
    rig.router.stats.rollover(rig.now)
    await rig.controller()
    assert rig.router.small.risk["prefill"]["busiest_share"] == 1.0
    assert rig.router.small.risk["decode"]["busiest_share"] == 0.0


async def test_a_unified_fleet_reports_one_role_share(tmp_path: Path) -> None:
    unified = [
        {"id": f"u{i}", "url": f"http://127.0.0.1:{i + 1}", "role": "both"} for i in range(2)
    ]
    rig = make_rig(tmp_path, engines=unified)
    traffic(rig, {"u0": 1, "u1": 3})
    rig.clock.advance(INTERVAL_S)
    rig.router.stats.rollover(rig.now)
    await rig.controller()
    assert rig.router.small.risk == {"both": {"eligible": 2, "busiest_share": 0.75, "high": False}}


# --------------------------------------------------------------------------- rebalancing
REBALANCE_FLEET = [
    {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill", "kv_role": "kv_producer"},
    {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode", "kv_role": "kv_consumer"},
    {"id": "d1", "url": "http://127.0.0.1:3", "role": "decode", "kv_role": "kv_both"},
]
# One prefill engine (too little with the default minimum of 2) against three decode engines.
THIN_PREFILL = [
    *REBALANCE_FLEET,
    {"id": "d2", "url": "http://127.0.0.1:4", "role": "decode", "kv_role": "kv_consumer"},
]


def rebalance_rig(
    tmp_path: Path, engines: list[dict[str, Any]] = REBALANCE_FLEET, **controller: Any
) -> Rig:
    return make_rig(tmp_path, engines=engines, rebalance_roles=True, **controller)


@dataclass
class FakeVerify:
    """A `verify_role` that answers `ok`, can act while 'verifying', and can be held open."""

    ok: bool
    during: Callable[[], None] | None = None
    gate: asyncio.Event | None = None
    raises: Exception | None = None
    calls: list[tuple[str, Role]] = field(default_factory=list)

    async def __call__(self, engine: EngineState, role: Role) -> tuple[bool, str]:
        self.calls.append((engine.id, role))
        if self.gate is not None:
            await self.gate.wait()
        if self.during is not None:
            self.during()
        if self.raises is not None:
            raise self.raises
        return self.ok, "fake verification " + ("passed" if self.ok else "failed")


def install(rig: Rig, verify: FakeVerify) -> None:
    r = rig.router
    r.small = SmallStages(r.config, r.fleet, r.lifecycle, r.metrics, r.stats, verify)


async def verify_and_apply(rig: Rig) -> None:
    """One pass starts the background verification; once it is done, the next applies it."""
    await rig.controller()
    task = rig.router.small.verification
    assert task is not None, "no verification was started"
    await asyncio.wait_for(task, timeout=5)
    await rig.controller()


def pick(rig: Rig) -> tuple[str, Role] | None:
    found = rebalance_candidate(rig.router.fleet, rig.now, rig.router.small.rebalance_settings)
    return None if found is None else (found[0].id, found[1])


def rebalanced(rig: Rig, result: str, src: str = "decode", dst: str = "prefill") -> float | None:
    return rig.metric("narwhal_role_rebalances_total", from_role=src, to_role=dst, result=result)


async def test_no_rebalance_while_every_role_has_enough_capacity(tmp_path: Path) -> None:
    # One prefill engine is "too little", but decode has only two: moving one would leave
    # decode no better off than prefill, so nothing moves.
    rig = rebalance_rig(tmp_path)
    assert pick(rig) is None


async def test_an_idle_unheld_kv_both_engine_is_picked_for_the_empty_role(
    tmp_path: Path,
) -> None:
    rig = rebalance_rig(tmp_path)
    rig.eject("p0")
    assert pick(rig) == ("d1", Role.PREFILL)
    # Pure: picking changes nothing.
    assert rig.engine("d1").role is Role.DECODE
    assert rig.candidates(Role.DECODE) == {"d0", "d1"}


async def test_a_role_with_too_little_capacity_gets_an_engine(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path, engines=THIN_PREFILL)
    assert rig.candidates(Role.PREFILL) == {"p0"}  # capacity, but below the minimum of 2
    assert pick(rig) == ("d1", Role.PREFILL)


async def test_the_minimum_is_configurable(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path, engines=THIN_PREFILL, rebalance_min_eligible=1)
    assert pick(rig) is None  # one prefill engine is enough now
    rig.eject("p0")
    assert pick(rig) == ("d1", Role.PREFILL)


async def test_a_move_is_never_undone_by_the_next_pass(tmp_path: Path) -> None:
    # After d1 moves, prefill and decode have two each: neither is short any more.
    rig = rebalance_rig(tmp_path, engines=THIN_PREFILL, rebalance_min_eligible=3)
    verify = FakeVerify(ok=True)
    install(rig, verify)
    await verify_and_apply(rig)
    assert rig.engine("d1").role is Role.PREFILL
    assert pick(rig) is None
    await rig.controller()
    assert len(verify.calls) == 1


async def test_the_move_can_go_the_other_way(tmp_path: Path) -> None:
    rig = rebalance_rig(
        tmp_path,
        engines=[
            {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill", "kv_role": "kv_both"},
            {"id": "p1", "url": "http://127.0.0.1:2", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:3", "role": "decode"},
        ],
    )
    rig.eject("d0")
    assert pick(rig) == ("p0", Role.DECODE)


async def test_idle_enough_is_at_or_below_the_in_flight_limit(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path)
    rig.eject("p0")
    set_in_flight(rig.router.fleet, "d1", 1)  # the default limit
    assert pick(rig) == ("d1", Role.PREFILL)
    set_in_flight(rig.router.fleet, "d1", 2)
    assert pick(rig) is None


async def test_a_busy_kv_both_engine_is_not_moved(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path, rebalance_max_in_flight=0)
    rig.eject("p0")
    set_in_flight(rig.router.fleet, "d1", 1)
    assert pick(rig) is None


async def test_a_held_kv_both_engine_is_not_moved(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path)
    rig.eject("p0")
    # Both decode engines drift-held: both stay candidates (protection), neither is unheld.
    for engine_id in ("d0", "d1"):
        rig.router.lifecycle.hold(
            rig.engine(engine_id), HoldName.PERFORMANCE_DRIFT, "slow", rig.now, duration_s=60
        )
    assert rig.candidates(Role.DECODE) == {"d0", "d1"}
    assert pick(rig) is None


async def test_only_kv_both_engines_are_moved(tmp_path: Path) -> None:
    rig = rebalance_rig(
        tmp_path,
        engines=[
            {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode"},
            {"id": "d1", "url": "http://127.0.0.1:3", "role": "decode"},
        ],
    )
    rig.eject("p0")
    assert pick(rig) is None


@pytest.mark.parametrize("other", ["ejected", "drained"])
async def test_rebalancing_never_empties_the_other_role(tmp_path: Path, other: str) -> None:
    rig = rebalance_rig(tmp_path)
    rig.eject("p0")
    if other == "ejected":
        rig.eject("d0")
    else:
        rig.router.operator.drain("d0")
    assert rig.candidates(Role.DECODE) == {"d1"}
    assert pick(rig) is None


async def test_failed_verification_does_not_switch(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path)
    verify = FakeVerify(ok=False)
    install(rig, verify)
    rig.eject("p0")
    await verify_and_apply(rig)
    assert verify.calls == [("d1", Role.PREFILL)]
    assert rig.engine("d1").role is Role.DECODE
    assert rig.candidates(Role.PREFILL) == set()
    assert rig.router.small.rebalances == [
        {
            "engine": "d1",
            "from": "decode",
            "to": "prefill",
            "ok": False,
            "reason": "fake verification failed",
        }
    ]
    assert rebalanced(rig, "verification_failed") == 1
    assert rebalanced(rig, "moved") == 0
    await rig.router.handoff.stage(rig.now)
    doc = handoff_document(rig)
    assert doc["engines"]["d1"]["role"] == "decode"
    # Verification sends real requests: it is not retried on the very next pass.
    await rig.controller()
    assert rig.router.small.verification is not None
    assert rig.router.small.verifying is None
    assert len(verify.calls) == 1


async def test_a_verification_that_raises_is_a_failed_verification(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path)
    verify = FakeVerify(ok=True, raises=RuntimeError("probe exploded"))
    install(rig, verify)
    rig.eject("p0")
    await verify_and_apply(rig)
    assert rig.engine("d1").role is Role.DECODE
    assert "RuntimeError: probe exploded" in rig.router.small.rebalances[-1]["reason"]
    assert rebalanced(rig, "verification_failed") == 1


async def test_passed_verification_switches_and_the_role_is_persisted(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path)
    verify = FakeVerify(ok=True)
    install(rig, verify)
    rig.eject("p0")
    await verify_and_apply(rig)
    assert verify.calls == [("d1", Role.PREFILL)]
    assert rig.engine("d1").role is Role.PREFILL
    assert rig.candidates(Role.PREFILL) == {"d1"}
    assert rig.candidates(Role.DECODE) == {"d0"}
    assert rig.router.small.rebalances[-1]["ok"] is True
    assert rebalanced(rig, "moved") == 1
    # The risk computed in the same pass already sees the new roles.
    assert rig.router.small.risk["prefill"]["eligible"] == 1

    await rig.router.handoff.stage(rig.now)
    doc = handoff_document(rig)
    assert doc["engines"]["d1"]["role"] == "prefill"
    assert doc["engines"]["d0"]["role"] == "decode"

    # A restart with --resume restores the moved role.
    again = Router(rig.router.config, clock=rig.clock, resume=True)
    verdict = await resume(again.config, again.handoff, again.fleet, again.clock, again.metrics)
    assert verdict.ok, verdict.reason
    assert again.fleet.get("d1").role is Role.PREFILL

    # Once moved, nothing more to do: the next pass does not verify again.
    await rig.controller()
    assert len(verify.calls) == 1


async def test_verification_runs_outside_the_monitor_pass(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path)
    verify = FakeVerify(ok=True, gate=asyncio.Event())
    install(rig, verify)
    rig.eject("p0")
    # The pass returns while verification is still waiting on the engine...
    await asyncio.wait_for(rig.controller(), timeout=5)
    await eventually(lambda: verify.calls, timeout_s=5, what="the background verification")
    assert verify.calls == [("d1", Role.PREFILL)]
    assert rig.router.small.verifying == ("d1", Role.PREFILL)
    assert rig.engine("d1").role is Role.DECODE
    # ...later passes neither wait for it nor start a second one...
    for _ in range(3):
        rig.clock.advance(1.0)
        await asyncio.wait_for(rig.controller(), timeout=5)
    assert len(verify.calls) == 1
    assert rig.engine("d1").role is Role.DECODE
    # ...and the pass after it finishes applies the move.
    assert verify.gate is not None
    verify.gate.set()
    task = rig.router.small.verification
    assert task is not None
    await asyncio.wait_for(task, timeout=5)
    assert rig.engine("d1").role is Role.DECODE  # not applied outside a pass
    await rig.controller()
    assert rig.engine("d1").role is Role.PREFILL


async def test_traffic_during_verification_does_not_cancel_the_move(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path)

    def busy() -> None:
        set_in_flight(rig.router.fleet, "d1", 5)  # d1 is still a decode candidate while verified
        set_in_flight(rig.router.fleet, "d0", 2)

    verify = FakeVerify(ok=True, during=busy)
    install(rig, verify)
    rig.eject("p0")
    await verify_and_apply(rig)
    assert rig.engine("d1").role is Role.PREFILL
    assert rebalanced(rig, "moved") == 1


async def test_a_hold_during_verification_cancels_the_move(tmp_path: Path) -> None:
    rig = rebalance_rig(tmp_path)
    verify = FakeVerify(
        ok=True,
        during=lambda: rig.router.lifecycle.hold(
            rig.engine("d1"), HoldName.PERFORMANCE_DRIFT, "slow", rig.now, duration_s=60
        ),
    )
    install(rig, verify)
    rig.eject("p0")
    await verify_and_apply(rig)
    assert rig.engine("d1").role is Role.DECODE
    assert "fleet changed during verification" in rig.router.small.rebalances[-1]["reason"]
    assert rebalanced(rig, "stale") == 1


async def test_rebalancing_is_off_unless_configured(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, engines=REBALANCE_FLEET)
    verify = FakeVerify(ok=True)
    install(rig, verify)
    rig.eject("p0")
    await rig.controller()
    assert verify.calls == []
    assert rig.router.small.verification is None
    assert rig.engine("d1").role is Role.DECODE


async def test_rebalancing_never_empties_the_other_role_during_verification(
    tmp_path: Path,
) -> None:
    rig = rebalance_rig(tmp_path)
    verify = FakeVerify(ok=True, during=lambda: rig.eject("d0"))
    install(rig, verify)
    rig.eject("p0")
    await verify_and_apply(rig)
    assert verify.calls == [("d1", Role.PREFILL)]
    assert rig.engine("d1").role is Role.DECODE
    assert rig.candidates(Role.DECODE) == {"d1"}
    assert rebalanced(rig, "stale") == 1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rebalance_min_eligible", 0),
        ("rebalance_max_in_flight", -1),
        ("rebalance_max_in_flight", 1.5),
    ],
)
def test_rebalance_keys_are_validated(tmp_path: Path, key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        make_rig(tmp_path, **{key: value})
