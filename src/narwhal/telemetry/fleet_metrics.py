"""The fleet's metrics: counters from each applied event, gauges read from the state at
scrape time (so a gauge can never disagree with `/admin/engines`)."""

from __future__ import annotations

from collections.abc import Callable

from narwhal.clock import Clock
from narwhal.config import Role
from narwhal.engine.failures import FailureClass
from narwhal.fleet.events import Event, LegFailed
from narwhal.fleet.holds import HoldName
from narwhal.fleet.reducer import Step
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics


def watch_fleet(fleet: Fleet, metrics: Metrics, clock: Clock) -> None:
    def observe(before: EngineState, after: EngineState, event: Event, step: Step) -> None:
        if isinstance(event, LegFailed):
            metrics.failures.labels(before.id, event.failure_class.value).inc()
        if step.reason is not None:
            now = clock.monotonic()
            old, new = before.status(now), after.status(now)
            if old != new:
                metrics.transitions.labels(before.id, new.split("(")[0]).inc()
        if before.ejected is None and after.ejected is not None:
            metrics.ejections.labels(after.id, after.ejected.cause).inc()

    models: dict[str, tuple[str, ...]] = {}  # each member's model label

    def gauges(engine_id: str, present: bool) -> None:
        """A member's gauges from its first moment; gone with it (its counters stay)."""
        if not present:
            for name in models.pop(engine_id, ()):
                metrics.engine_model.remove(engine_id, name)
            metrics.in_flight.remove(engine_id)
            metrics.liveness_misses.remove(engine_id)
            for cls in FailureClass:
                metrics.evidence_streak.remove(engine_id, cls.value)
            for name in HoldName:
                metrics.holds_active.remove(engine_id, name.value)
            return
        served = fleet.get(engine_id).model
        if served is not None:
            models[engine_id] = (served,)
            metrics.engine_model.labels(engine_id, served).set(1)
        metrics.in_flight.labels(engine_id).set_function(_in_flight(fleet, engine_id))
        metrics.liveness_misses.labels(engine_id).set_function(_liveness(fleet, engine_id))
        for cls in FailureClass:
            metrics.evidence_streak.labels(engine_id, cls.value).set_function(
                _streak(fleet, engine_id, cls)
            )
        for name in HoldName:
            metrics.holds_active.labels(engine_id, name.value).set_function(
                _hold_active(fleet, engine_id, name, clock)
            )

    fleet.observe(observe)
    fleet.observe_membership(gauges)
    for engine in fleet:
        gauges(engine.id, True)
    for role in Role:
        metrics.engines_unverified.labels(role.value).set_function(_unverified(fleet, role))


def _in_flight(fleet: Fleet, engine_id: str) -> Callable[[], float]:
    return lambda: float(fleet.in_flight.of(engine_id))


def _liveness(fleet: Fleet, engine_id: str) -> Callable[[], float]:
    return lambda: float(fleet.get(engine_id).liveness_misses)


def _streak(fleet: Fleet, engine_id: str, cls: FailureClass) -> Callable[[], float]:
    return lambda: float(fleet.get(engine_id).evidence.get(cls, 0))


def _hold_active(fleet: Fleet, engine_id: str, name: HoldName, clock: Clock) -> Callable[[], float]:
    """A hold counts until its deadline and not after, whether or not a monitor pass has
    removed it yet (as candidate selection does)."""

    def active() -> float:
        hold = fleet.get(engine_id).holds.get(name)
        return float(hold is not None and not hold.expired(clock.monotonic()))

    return active


def _unverified(fleet: Fleet, role: Role) -> Callable[[], float]:
    return lambda: float(sum(1 for e in fleet if e.role is role and not e.verified))
