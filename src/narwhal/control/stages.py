"""The smaller monitor stages: controller, drains, rollover, telemetry.

controller: performance drift over closed intervals (detect or enforce), consolidation risk,
and optional role rebalancing of `kv_both` engines. rollover closes interval windows.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from narwhal.config import Config, KvRole, Role
from narwhal.control.drift import Drift, DriftSettings, find_drift
from narwhal.control.fleet import EngineState, Fleet
from narwhal.control.holds import HoldName
from narwhal.control.intervals import IntervalStats
from narwhal.control.lifecycle import Lifecycle
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.stages")

VerifyRole = Callable[[EngineState, Role], Awaitable[tuple[bool, str]]]


def consolidation_risk(fleet: Fleet, now: float) -> dict[str, dict[str, Any]]:
    """Per role: how many eligible engines carry it; one or none is high risk."""
    risk: dict[str, dict[str, Any]] = {}
    for role in fleet.needed_roles():
        eligible = fleet.candidates(role, now)
        total = sum(c.in_flight for c in eligible)
        busiest = max((c.in_flight for c in eligible), default=0)
        risk[role.value] = {
            "eligible": len(eligible),
            "busiest_share": (busiest / total) if total else 0.0,
            "high": len(eligible) <= 1,
        }
    return risk


def rebalance_candidate(fleet: Fleet, now: float) -> tuple[EngineState, Role] | None:
    """A `kv_both` engine to move into a role that has no eligible engine, if one can go.

    Only an idle, unheld engine moves, and only when its current role keeps at least one
    other eligible engine: rebalancing never empties the other role.
    """
    for needy, other in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
        if fleet.candidates(needy, now):
            continue
        donors = fleet.candidates(other, now)
        if len(donors) < 2:
            continue
        for c in sorted(donors, key=lambda c: (c.in_flight, c.id)):
            engine = fleet.get(c.id)
            if (
                engine.config.effective_kv_role is KvRole.BOTH
                and engine.role is other
                and engine.in_flight == 0
                and not engine.active_holds(now)
            ):
                return engine, needy
    return None


class SmallStages:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        lifecycle: Lifecycle,
        metrics: Metrics,
        stats: IntervalStats,
        verify_role: VerifyRole,
    ) -> None:
        self._cfg = config
        self._fleet = fleet
        self._lifecycle = lifecycle
        self._metrics = metrics
        self.stats = stats
        self._verify_role = verify_role
        self.risk: dict[str, dict[str, Any]] = {}
        self.drains_settled: dict[str, float] = {}
        self.drift: list[Drift] = []
        self._drift_seen_window: float | None = None
        self.rebalances: list[dict[str, Any]] = []
        self._rebalance_retry: dict[str, float] = {}

    async def controller(self, now: float) -> None:
        self._performance_drift(now)
        if self._cfg.controller.rebalance_roles:
            await self._rebalance(now)
        self.risk = consolidation_risk(self._fleet, now)
        for role, r in self.risk.items():
            self._metrics.eligible_engines.labels(role).set(r["eligible"])
            self._metrics.consolidation_high.labels(role).set(int(r["high"]))

    def _performance_drift(self, now: float) -> None:
        c = self._cfg.controller
        if c.drift_mode == "off" or not self.stats.closed:
            return
        newest = self.stats.closed[-1].started
        if newest == self._drift_seen_window:
            return  # decide once per closed interval
        self._drift_seen_window = newest
        roles: dict[str, list[str]] = {}
        for e in self._fleet:
            for r in Fleet.roles_of(e):
                roles.setdefault(r.value, []).append(e.id)
        settings = DriftSettings(c.drift_factor, c.drift_min_samples, c.drift_intervals)
        self.drift = find_drift(list(self.stats.closed), roles, settings)
        for d in self.drift:
            self._metrics.drift_detected.labels(d.engine_id).inc()
            log.warning("engine %s performance drift (%s): %s", d.engine_id, c.drift_mode, d.reason)
            if c.drift_mode == "enforce":
                self._lifecycle.hold(
                    self._fleet.get(d.engine_id),
                    HoldName.PERFORMANCE_DRIFT,
                    d.reason,
                    now,
                    duration_s=c.drift_hold_s,
                )

    async def _rebalance(self, now: float) -> None:
        found = rebalance_candidate(self._fleet, now)
        if found is None or now < self._rebalance_retry.get(found[0].id, 0.0):
            return
        engine, role = found
        ok, reason = await self._verify_role(engine, role)
        if ok and rebalance_candidate(self._fleet, now) != found:
            ok, reason = (
                False,
                "the fleet changed during verification",
            )  # re-check: never empty a role
        record = {
            "engine": engine.id,
            "from": engine.role.value,
            "to": role.value,
            "ok": ok,
            "reason": reason,
        }
        self.rebalances = [*self.rebalances[-9:], record]
        if not ok:
            log.warning("engine %s not moved to %s: %s", engine.id, role.value, reason)
            # Verification sends real requests: do not retry it every pass.
            self._rebalance_retry[engine.id] = now + 30 * self._cfg.controller.monitor_interval_s
            return

        def change(e: EngineState) -> None:
            e.role = role

        self._fleet.transition(
            engine, now, f"role {engine.role.value} -> {role.value} (rebalanced: {reason})", change
        )

    async def drains(self, now: float) -> None:
        """Settle drains: record when a drained engine's in-flight count reached zero."""
        for engine in self._fleet:
            drained = HoldName.OPERATOR_DRAIN in engine.holds or (
                HoldName.PLANNED_MAINTENANCE in engine.holds
            )
            if not drained:
                self.drains_settled.pop(engine.id, None)
            elif engine.in_flight == 0 and engine.id not in self.drains_settled:
                self.drains_settled[engine.id] = now
                log.info("engine %s: drain settled (no requests in flight)", engine.id)

    async def rollover(self, now: float) -> None:
        """Close the interval window once `controller.interval_s` has passed."""
        self.stats.rollover(now)

    async def telemetry(self, now: float) -> None:
        for engine in self._fleet:
            self._lifecycle.expire_holds(engine, now)
            for name in HoldName:
                active = name in engine.holds and not engine.holds[name].expired(now)
                self._metrics.holds_active.labels(engine.id, name.value).set(int(active))
            for cls, streak in engine.evidence.items():
                self._metrics.evidence_streak.labels(engine.id, cls.value).set(streak)
            self._metrics.engine_eligible.labels(engine.id).set(
                int(self._fleet.eligible(engine, now))
            )
            self._metrics.engine_ejected.labels(engine.id).set(int(engine.ejected is not None))
