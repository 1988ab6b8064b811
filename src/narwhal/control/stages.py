"""The smaller monitor stages: controller, drains, rollover, readmission, telemetry.

Each is a real, minimal behaviour today; later work extends them in place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from narwhal.config import Config
from narwhal.control.fleet import Fleet
from narwhal.control.holds import HoldName
from narwhal.control.lifecycle import Lifecycle
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.stages")


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


@dataclass(slots=True)
class IntervalWindow:
    """Per-engine counts over one `controller.interval_s` window."""

    started: float
    requests: dict[str, int] = field(default_factory=dict)


class SmallStages:
    def __init__(
        self, config: Config, fleet: Fleet, lifecycle: Lifecycle, metrics: Metrics
    ) -> None:
        self._cfg = config
        self._fleet = fleet
        self._lifecycle = lifecycle
        self._metrics = metrics
        self.risk: dict[str, dict[str, Any]] = {}
        self.drains_settled: dict[str, float] = {}
        self.window: IntervalWindow | None = None
        self.closed_windows: list[IntervalWindow] = []

    async def controller(self, now: float) -> None:
        self.risk = consolidation_risk(self._fleet, now)

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
        if self.window is None:
            self.window = IntervalWindow(started=now)
        elif now - self.window.started >= self._cfg.controller.interval_s:
            self.closed_windows = [*self.closed_windows[-9:], self.window]
            self.window = IntervalWindow(started=now)

    async def telemetry(self, now: float) -> None:
        for engine in self._fleet:
            self._lifecycle.expire_holds(engine, now)
            for name in HoldName:
                active = name in engine.holds and not engine.holds[name].expired(now)
                self._metrics.holds_active.labels(engine.id, name.value).set(int(active))
            self._metrics.in_flight.labels(engine.id).set(engine.in_flight)
