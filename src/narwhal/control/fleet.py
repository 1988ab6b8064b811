"""What Narwhal knows about each engine, and who may receive new work.

`EngineState` is plain data; `Fleet` owns the states and answers eligibility questions as
pure reads (`candidates(role, now)` never mutates). Changes go through `transition`.

An engine starts *unverified* (DESIGN §10): it is never a candidate until a healthy answer
naming the configured model verifies it (or a restored handoff says it was verified), so a
router started in front of engines still loading routes nothing to them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from narwhal.config import EngineConfig, Role
from narwhal.control.counters import Counters
from narwhal.control.holds import SOFT_HOLDS, Hold, HoldName
from narwhal.engine.failures import FailureClass

log = logging.getLogger("narwhal.fleet")

NOT_YET_SEEN = "not yet seen healthy"


@dataclass(frozen=True, slots=True)
class Ejection:
    """Why and when an engine was taken out of placement."""

    cause: str  # a FailureClass value, or "liveness"
    reason: str
    at_wall: float
    evidence: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "reason": self.reason,
            "at": self.at_wall,
            "evidence": dict(self.evidence),
        }

    def admin_json(self) -> dict[str, Any]:
        """`/admin/engines`' `ejection` record: `to_json` plus `class`, the failure class (or
        `liveness`) that ejected the engine. Kept out of `to_json`, whose shape the handoff
        schema fixes."""
        return {**self.to_json(), "class": self.cause}


@dataclass(slots=True)
class EngineState:
    config: EngineConfig
    role: Role
    in_flight: int = 0
    evidence: dict[FailureClass, int] = field(default_factory=dict)
    liveness_misses: int = 0
    ejected: Ejection | None = None
    holds: dict[HoldName, Hold] = field(default_factory=dict)
    generation: float | None = None
    max_model_len: int | None = None
    verified: bool = False
    unverified_reason: str | None = NOT_YET_SEEN  # why not verified yet (None once verified)

    @property
    def id(self) -> str:
        return self.config.id

    def serves(self, role: Role) -> bool:
        return self.role is role or self.role is Role.BOTH

    def active_holds(self, now: float) -> list[Hold]:
        return [h for h in self.holds.values() if not h.expired(now)]

    def active_holds_by_name(self, now: float) -> set[HoldName]:
        return {h.name for h in self.active_holds(now)}

    def status(self, now: float) -> str:
        """A one-word summary for transition logs: ejected, held(...), unverified or
        in-service, the first that applies."""
        if self.ejected is not None:
            return "ejected"
        held = sorted(h.name.value for h in self.active_holds(now))
        if held:
            return "held(" + ",".join(held) + ")"
        return "in-service" if self.verified else "unverified"


@dataclass(frozen=True, slots=True)
class Candidate:
    """An eligible engine as placement sees it."""

    id: str
    in_flight: int


TransitionHook = Callable[[EngineState, str, str, str], None]


class Fleet:
    """The engines of one router, indexed by id."""

    def __init__(self, engines: Iterable[EngineConfig]) -> None:
        self._engines = {e.id: EngineState(config=e, role=e.role) for e in engines}
        self._hooks: list[TransitionHook] = []
        self.counters = Counters()

    def __iter__(self) -> Any:
        return iter(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    def get(self, engine_id: str) -> EngineState:
        return self._engines[engine_id]

    def has(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def on_transition(self, hook: TransitionHook) -> None:
        self._hooks.append(hook)

    def transition(
        self, engine: EngineState, now: float, reason: str, change: Callable[[EngineState], None]
    ) -> None:
        """The one place engine state changes: apply, then log `from -> to (reason)`."""
        before = engine.status(now)
        change(engine)
        after = engine.status(now)
        log.info(
            "engine %s: %s -> %s (%s)",
            engine.id,
            before,
            after,
            reason,
            extra={"engine": engine.id, "from": before, "to": after, "reason": reason},
        )
        for hook in self._hooks:
            hook(engine, before, after, reason)

    def candidates(self, role: Role, now: float) -> list[Candidate]:
        """Engines that may take new work for `role`, with last-engine protection.

        Soft holds (drift, quarantine) are honoured only while another engine of the role
        remains eligible; an expired hold no longer counts (no monitor pass needed). An
        unverified engine is never a candidate, last engine or not.
        """
        base = [
            e
            for e in self._engines.values()
            if e.serves(role)
            and e.verified
            and e.ejected is None
            and not any(h.name not in SOFT_HOLDS for h in e.active_holds(now))
        ]
        free = [e for e in base if not e.active_holds(now)]
        chosen = free or base
        return [Candidate(e.id, e.in_flight) for e in chosen]

    def verification_peers(self, role: Role, now: float) -> list[EngineState]:
        """Engines of `role` kept out only by an `inference_verification` hold (and soft
        holds): the stand-in peers of an inference probe when no engine is eligible."""
        return [
            e
            for e in self._engines.values()
            if e.serves(role)
            and e.verified
            and e.ejected is None
            and {h.name for h in e.active_holds(now) if h.name not in SOFT_HOLDS}
            == {HoldName.INFERENCE_VERIFICATION}
        ]

    def eligible(self, engine: EngineState, now: float) -> bool:
        return any(
            c.id == engine.id for r in self.roles_of(engine) for c in self.candidates(r, now)
        )

    @staticmethod
    def roles_of(engine: EngineState) -> tuple[Role, ...]:
        return (Role.PREFILL, Role.DECODE) if engine.role is Role.BOTH else (engine.role,)

    def needed_roles(self) -> tuple[Role, ...]:
        """Roles a request needs: both legs for a PD fleet, one for a unified fleet."""
        if all(e.role is Role.BOTH for e in self._engines.values()):
            return (Role.BOTH,)
        return (Role.PREFILL, Role.DECODE)

    def has_verified(self, role: Role) -> bool:
        """Whether any engine serving `role` has been verified (ejected or not)."""
        return any(e.verified and e.serves(role) for e in self._engines.values())

    def roles_without_verified(self) -> list[Role]:
        """Needed roles that no verified engine serves yet: `/ready` says `starting` for
        them (an ejected engine that was verified still counts: that is lost capacity)."""
        return [r for r in self.needed_roles() if not self.has_verified(r)]
