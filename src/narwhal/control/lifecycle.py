"""The control plane's words for engine changes: each one is one event to `Fleet.apply`.

Verification, ejection, holds, health and readmission are decided by the reducer
(`narwhal.fleet.reducer`); these methods only name the event and the moment.
"""

from __future__ import annotations

from narwhal.fleet.events import (
    EjectRequested,
    HealthOk,
    HoldReleased,
    HoldRequested,
    HoldsExpired,
    Readmitted,
    VerificationSeen,
)
from narwhal.fleet.holds import HoldName
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet


class Lifecycle:
    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def verify(
        self,
        engine: EngineState,
        verified: bool,
        reason: str,
        now: float,
        models: tuple[str, ...] = (),
        adapters: tuple[str, ...] = (),
    ) -> None:
        """The outcome of one look at an unverified engine (DESIGN §10): `verified` makes it
        eligible, for its model and the `models` it reported (`adapters`: those that are LoRA
        adapters); otherwise a new reason why not is recorded (logged once per change)."""
        self._fleet.apply(VerificationSeen(engine.id, verified, reason, models, adapters), now)

    def eject(self, engine: EngineState, cause: str, reason: str, now: float) -> None:
        """Take an engine out of placement (a confirmed failure: no last-engine protection)."""
        self._fleet.apply(EjectRequested(engine.id, cause, reason), now)

    def hold(
        self,
        engine: EngineState,
        name: HoldName,
        reason: str,
        now: float,
        duration_s: float | None = None,
        newer_than: float | None = None,
    ) -> None:
        self._fleet.apply(HoldRequested(engine.id, name, reason, duration_s, newer_than), now)

    def release(self, engine: EngineState, name: HoldName, reason: str, now: float) -> None:
        self._fleet.apply(HoldReleased(engine.id, name, reason), now)

    def health_ok(self, engine: EngineState, now: float) -> None:
        """A health 200: clears its evidence, resets liveness, ends a failure quarantine
        (never an operator drain: drains survive successful health)."""
        self._fleet.apply(HealthOk(engine.id), now)

    def expire_holds(self, engine: EngineState, now: float) -> None:
        self._fleet.apply(HoldsExpired(engine.id), now)

    def readmit(
        self, engine: EngineState, reason: str, now: float, *, operator: bool = False
    ) -> None:
        """Back in placement after verification; only an operator's readmission also
        clears an operator drain."""
        self._fleet.apply(Readmitted(engine.id, reason, operator), now)
