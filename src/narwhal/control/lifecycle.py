"""Engine lifecycle changes: verification, ejection, holds, readmission — all through
`Fleet.transition`.

These are the edge where decisions (evidence actions, probes, operator requests) become
state; each change is logged `from -> to (reason)` and counted once.
"""

from __future__ import annotations

from collections.abc import Callable

from narwhal.clock import Clock
from narwhal.config import Config, Role
from narwhal.control.fleet import Ejection, EngineState, Fleet
from narwhal.control.holds import Hold, HoldName
from narwhal.telemetry.metrics import Metrics


class Lifecycle:
    def __init__(self, config: Config, fleet: Fleet, metrics: Metrics, clock: Clock) -> None:
        self._cfg = config
        self._fleet = fleet
        self._metrics = metrics
        self._clock = clock
        fleet.on_transition(self._count)
        for engine in fleet:
            for name in HoldName:
                metrics.holds_active.labels(engine.id, name.value).set_function(
                    _hold_active(engine, name, clock)
                )
        for role in Role:
            metrics.engines_unverified.labels(role.value).set_function(_unverified(fleet, role))

    def _count(self, engine: EngineState, before: str, after: str, reason: str) -> None:
        if before != after:
            self._metrics.transitions.labels(engine.id, after.split("(")[0]).inc()

    def verify(self, engine: EngineState, verified: bool, reason: str, now: float) -> None:
        """The outcome of one look at an unverified engine: `verified` makes it eligible
        (DESIGN §10); otherwise a new reason why not is recorded (logged once per change,
        not once per sweep). A verified engine stays verified: later trouble is evidence."""
        if engine.verified or (not verified and engine.unverified_reason == reason):
            return

        def change(e: EngineState) -> None:
            e.verified = verified
            e.unverified_reason = None if verified else reason

        label = "verified" if verified else "not verified"
        self._fleet.transition(engine, now, f"{label}: {reason}", change)

    def eject(self, engine: EngineState, cause: str, reason: str, now: float) -> None:
        """Take an engine out of placement (a confirmed failure: no last-engine protection)."""
        if engine.ejected is not None:
            return
        record = Ejection(
            cause, reason, self._clock.wall(), {k.value: v for k, v in engine.evidence.items()}
        )
        quarantine_s = self._cfg.recovery.failure_quarantine_s

        def change(e: EngineState) -> None:
            e.ejected = record
            if quarantine_s is not None:
                e.holds[HoldName.FAILURE_QUARANTINE] = self._temporary(
                    HoldName.FAILURE_QUARANTINE, f"{cause}: {reason}", now, quarantine_s
                )

        self._fleet.transition(engine, now, f"ejected: {cause}: {reason}", change)
        self._metrics.ejections.labels(engine.id, cause).inc()
        self._fleet.counters.ejections[engine.id] += 1

    def _temporary(self, name: HoldName, reason: str, now: float, duration_s: float) -> Hold:
        wall = self._clock.wall()
        return Hold(
            name, reason, wall, deadline_mono=now + duration_s, deadline_wall=wall + duration_s
        )

    def hold(
        self,
        engine: EngineState,
        name: HoldName,
        reason: str,
        now: float,
        duration_s: float | None = None,
        newer_than: float | None = None,
    ) -> None:
        if name in engine.holds and not engine.holds[name].expired(now):
            return
        hold = (
            self._temporary(name, reason, now, duration_s)
            if duration_s is not None
            else Hold(name, reason, self._clock.wall(), newer_than=newer_than)
        )
        self._fleet.transition(
            engine, now, f"hold {name.value}: {reason}", lambda e: e.holds.__setitem__(name, hold)
        )

    def release(self, engine: EngineState, name: HoldName, reason: str, now: float) -> None:
        if name not in engine.holds:
            return
        self._fleet.transition(
            engine, now, f"release {name.value}: {reason}", lambda e: _drop(e, name)
        )

    def health_ok(self, engine: EngineState, now: float) -> None:
        """A successful health response resets liveness and clears a failure quarantine.

        It never clears an operator drain (spec: drains survive successful health).
        """
        engine.liveness_misses = 0
        self._metrics.liveness_misses.labels(engine.id).set(0)
        self.release(engine, HoldName.FAILURE_QUARANTINE, "health 200", now)

    def expire_holds(self, engine: EngineState, now: float) -> None:
        """Drop holds whose deadline passed (selection already ignores them)."""
        for hold in list(engine.holds.values()):
            if hold.expired(now):
                self.release(engine, hold.name, "deadline passed", now)

    def readmit(
        self, engine: EngineState, reason: str, now: float, *, operator: bool = False
    ) -> None:
        """Return an engine to placement after verification; clears its evidence.

        Only a readmission the operator asked for clears an operator drain; automatic
        readmission (of an ejected engine, or after maintenance) leaves it in place. The
        pipeline checked health and the served model, so the engine is verified too.
        """
        cleared = [
            HoldName.PLANNED_MAINTENANCE,
            HoldName.INFERENCE_VERIFICATION,
            HoldName.FAILURE_QUARANTINE,
        ]
        if operator:
            cleared.append(HoldName.OPERATOR_DRAIN)

        def change(e: EngineState) -> None:
            e.ejected = None
            e.evidence.clear()
            e.liveness_misses = 0
            e.verified = True
            e.unverified_reason = None
            for name in cleared:
                e.holds.pop(name, None)

        self._fleet.transition(engine, now, f"readmitted: {reason}", change)
        self._fleet.counters.readmissions[engine.id] += 1


def _drop(engine: EngineState, name: HoldName) -> None:
    engine.holds.pop(name, None)


def _hold_active(engine: EngineState, name: HoldName, clock: Clock) -> Callable[[], float]:
    """`narwhal_holds_active`, read at scrape time: a hold counts until its deadline and not
    after, whether or not a monitor pass has removed it yet (as candidate selection does)."""

    def active() -> float:
        hold = engine.holds.get(name)
        return float(hold is not None and not hold.expired(clock.monotonic()))

    return active


def _unverified(fleet: Fleet, role: Role) -> Callable[[], float]:
    """`narwhal_engines_unverified{role}`, read at scrape time from the fleet's state."""

    def count() -> float:
        return float(sum(1 for e in fleet if e.role is role and not e.verified))

    return count
