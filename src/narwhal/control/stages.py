"""The smaller monitor stages: controller, drains, rollover, telemetry.

controller: performance drift over closed intervals (detect or enforce), consolidation risk,
and optional role rebalancing of `kv_both` engines. rollover closes interval windows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from narwhal.config import Config, KvRole, Role
from narwhal.control.drift import Drift, DriftSettings, find_drift
from narwhal.control.lifecycle import Lifecycle
from narwhal.fleet.events import RoleChanged
from narwhal.fleet.holds import HoldName
from narwhal.fleet.intervals import IntervalStats, Window
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.stages")

VerifyRole = Callable[[EngineState, Role], Awaitable[tuple[bool, str]]]
Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None] | None"]
"""Start work in the background (the leadership scope); None when this router does not lead."""


def consolidation_risk(
    fleet: Fleet, now: float, window: Window | None = None
) -> dict[str, dict[str, Any]]:
    """Per role: how many eligible engines carry it (one or none is high risk), and the
    busiest engine's share of the role's requests in `window` (the last closed interval).

    The share counts every engine serving the role, eligible or not: it describes where
    the traffic went, and is 0.0 when there is no closed interval or it saw no requests.
    """
    risk: dict[str, dict[str, Any]] = {}
    for role in fleet.needed_roles():
        eligible = fleet.candidates(role, now)
        counts = [
            window.engines[e.id].requests
            for e in fleet
            if window is not None and e.serves(role) and e.id in window.engines
        ]
        total = sum(counts)
        risk[role.value] = {
            "eligible": len(eligible),
            "busiest_share": (max(counts) / total) if total else 0.0,
            "high": len(eligible) <= 1,
        }
    return risk


@dataclass(frozen=True, slots=True)
class RebalanceSettings:
    """`min_eligible`: a role with fewer eligible engines has too little capacity.
    `max_in_flight`: a `kv_both` engine with at most this many requests is idle enough."""

    min_eligible: int = 2
    max_in_flight: int = 1


def _movable(engine: EngineState, donor_role: Role, now: float) -> bool:
    return (
        engine.config.effective_kv_role is KvRole.BOTH
        and engine.role is donor_role
        and engine.ejected is None
        and not engine.active_holds(now)
    )


def _short_roles(fleet: Fleet, now: float, settings: RebalanceSettings) -> list[tuple[Role, Role]]:
    """(needy, donor) pairs where a move helps: the needy role has too little capacity and
    the donor keeps at least as many eligible engines as the needy role will have (so
    never none, and a move is never undone by the next pass)."""
    if fleet.needed_roles() == (Role.BOTH,):
        return []
    pairs = []
    for needy, donor in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
        have = len(fleet.candidates(needy, now))
        give = len(fleet.candidates(donor, now))
        if have < settings.min_eligible and give - have >= 2:
            pairs.append((needy, donor))
    return pairs


def rebalance_candidate(
    fleet: Fleet, now: float, settings: RebalanceSettings = RebalanceSettings()
) -> tuple[EngineState, Role] | None:
    """A `kv_both` engine to move into a role with too little eligible capacity, if one can go.

    Only an idle-enough, unheld engine moves (the least busy first), and only when its
    current role keeps at least as many eligible engines as the needy role will have:
    rebalancing never empties the other role. Pure.
    """
    for needy, donor in _short_roles(fleet, now, settings):
        for c in sorted(fleet.candidates(donor, now), key=lambda c: (c.in_flight, c.id)):
            engine = fleet.get(c.id)
            if _movable(engine, donor, now) and c.in_flight <= settings.max_in_flight:
                return engine, needy
    return None


def rebalance_blocker(
    fleet: Fleet, engine_id: str, role: Role, now: float, settings: RebalanceSettings
) -> str | None:
    """Why a verified move of `engine_id` into `role` must not be applied now, or None.

    The re-check after verification compares by id and role: the move still stands when the
    role still has too little capacity, the engine is still an unheld eligible `kv_both`
    engine of the other role, and the other role keeps its capacity. In-flight counts may
    have changed meanwhile; requests already placed finish where they are.
    """
    if not fleet.has(engine_id):
        return f"engine {engine_id} is no longer configured"
    engine = fleet.get(engine_id)
    donor = Role.DECODE if role is Role.PREFILL else Role.PREFILL
    if (role, donor) not in _short_roles(fleet, now, settings):
        return f"role {role.value} no longer needs capacity from {donor.value}"
    if not _movable(engine, donor, now) or engine_id not in {
        c.id for c in fleet.candidates(donor, now)
    }:
        return f"engine {engine_id} is no longer an eligible, unheld {donor.value} engine"
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
        spawn: Spawn | None = None,
    ) -> None:
        self._cfg = config
        self._fleet = fleet
        self._lifecycle = lifecycle
        self._metrics = metrics
        self.stats = stats
        self._verify_role = verify_role
        self._spawn: Spawn = spawn or asyncio.create_task
        self.risk: dict[str, dict[str, Any]] = {}
        self.drains_settled: dict[str, float] = {}
        self.drift: list[Drift] = []
        self._drift_seen_window: float | None = None
        self.rebalances: list[dict[str, Any]] = []
        self._rebalance_retry: dict[str, float] = {}
        self.verifying: tuple[str, Role] | None = None
        self.verification: asyncio.Task[None] | None = None
        self._verified: tuple[str, Role, bool, str] | None = None

    def reconfigure(self, config: Config) -> None:
        """A reloaded config (control/reload.py): read from the next use on."""
        self._cfg = config

    @property
    def rebalance_settings(self) -> RebalanceSettings:
        c = self._cfg.controller
        return RebalanceSettings(c.rebalance_min_eligible, c.rebalance_max_in_flight)

    async def controller(self, now: float) -> None:
        self._performance_drift(now)
        if self._cfg.controller.rebalance_roles:
            self._rebalance(now)
        closed = self.stats.closed[-1] if self.stats.closed else None
        self.risk = consolidation_risk(self._fleet, now, closed)
        for role, r in self.risk.items():
            self._metrics.eligible_engines.labels(role).set(r["eligible"])
            self._metrics.consolidation_high.labels(role).set(int(r["high"]))
            self._metrics.busiest_share.labels(role).set(r["busiest_share"])

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
            log.warning(
                "engine %s performance drift (%s): %s",
                d.engine_id,
                c.drift_mode,
                d.reason,
                extra={"engine": d.engine_id, "reason": d.reason, "drift_mode": c.drift_mode},
            )
            if c.drift_mode == "enforce":
                self._lifecycle.hold(
                    self._fleet.get(d.engine_id),
                    HoldName.PERFORMANCE_DRIFT,
                    d.reason,
                    now,
                    duration_s=c.drift_hold_s,
                )

    def _rebalance(self, now: float) -> None:
        """Apply a finished verification, else start one in the background.

        Verification sends real requests, so it runs as a task outside the monitor pass; a
        later pass applies the move if `rebalance_blocker` finds it still right.
        """
        if self._verified is not None:
            engine_id, role, ok, reason = self._verified
            self._verified = None
            self._conclude(engine_id, role, ok, reason, now)
            return
        if self.verifying is not None:
            return  # still verifying
        found = rebalance_candidate(self._fleet, now, self.rebalance_settings)
        if found is None or now < self._rebalance_retry.get(found[0].id, 0.0):
            return
        engine, role = found
        self.verifying = (engine.id, role)
        log.info(
            "engine %s: verifying role %s before rebalancing",
            engine.id,
            role.value,
            extra={"engine": engine.id, "to": role.value},
        )
        task = self._spawn(self._verify(engine, role))
        if task is None:  # no longer leading: the next holder decides afresh
            self.verifying = None
            return
        self.verification = task

    async def _verify(self, engine: EngineState, role: Role) -> None:
        try:
            ok, reason = await self._verify_role(engine, role)
        except Exception as exc:  # a verification that raises is a failed verification
            ok, reason = False, f"verification raised {type(exc).__name__}: {exc}"
        finally:
            self.verifying = None
        self._verified = (engine.id, role, ok, reason)

    def _conclude(self, engine_id: str, role: Role, ok: bool, reason: str, now: float) -> None:
        engine = self._fleet.get(engine_id)
        from_role = engine.role.value
        result = "moved"
        if not ok:
            result = "verification_failed"
        else:
            blocker = rebalance_blocker(self._fleet, engine_id, role, now, self.rebalance_settings)
            if blocker is not None:
                ok, reason, result = (
                    False,
                    f"the fleet changed during verification: {blocker}",
                    "stale",
                )
        self._metrics.rebalances.labels(from_role, role.value, result).inc()
        record = {
            "engine": engine_id,
            "from": from_role,
            "to": role.value,
            "ok": ok,
            "reason": reason,
        }
        self.rebalances = [*self.rebalances[-9:], record]
        extra = {"engine": engine_id, "from": from_role, "to": role.value, "reason": reason}
        if not ok:
            log.warning("engine %s not moved to %s: %s", engine_id, role.value, reason, extra=extra)
            # Verification sends real requests: do not retry it every pass.
            self._rebalance_retry[engine_id] = now + 30 * self._cfg.controller.monitor_interval_s
            return
        log.info(
            "engine %s rebalanced %s -> %s (%s)",
            engine_id,
            from_role,
            role.value,
            reason,
            extra=extra,
        )
        self._fleet.apply(RoleChanged(engine_id, role, reason), now)

    async def drains(self, now: float) -> None:
        """Settle drains: record when a drained engine's in-flight count reached zero."""
        for engine in self._fleet:
            drained = HoldName.OPERATOR_DRAIN in engine.holds or (
                HoldName.PLANNED_MAINTENANCE in engine.holds
            )
            if not drained:
                self.drains_settled.pop(engine.id, None)
            elif self._fleet.in_flight.of(engine.id) == 0 and engine.id not in self.drains_settled:
                self.drains_settled[engine.id] = now
                log.info("engine %s: drain settled (no requests in flight)", engine.id)

    async def rollover(self, now: float) -> None:
        """Close the interval window once `controller.interval_s` has passed."""
        self.stats.rollover(now)

    async def telemetry(self, now: float) -> None:
        for engine in self._fleet:
            self._lifecycle.expire_holds(engine, now)  # holds_active is read at scrape time
            self._metrics.engine_eligible.labels(engine.id).set(
                int(self._fleet.eligible(engine, now))
            )
            self._metrics.engine_ejected.labels(engine.id).set(int(engine.ejected is not None))
