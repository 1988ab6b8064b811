"""`Fleet`: the engines' current states, the only place they change, and the eligibility reads.

`apply(event, now)` runs the reducer, swaps the new immutable state in, keeps the durable
counters, logs `from -> to (reason)` and tells the observers (metrics); it returns the effects
for the edge to run. Every read (`candidates(role, now)` and the rest) is pure: a getter never
mutates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from narwhal.clock import Clock
from narwhal.config import EngineConfig, Role
from narwhal.fleet.counters import Counters
from narwhal.fleet.events import Event, LegFailed, Readmitted, SuspectProbe
from narwhal.fleet.holds import SOFT_HOLDS, HoldName
from narwhal.fleet.inflight import InFlight, InFlightCounts
from narwhal.fleet.reducer import Context, Policy, Step, reduce
from narwhal.fleet.state import Candidate, EngineState

log = logging.getLogger("narwhal.fleet")

Observer = Callable[[EngineState, EngineState, Event, Step], None]
"""Told of every event that changed something: (before, after, event, step)."""
MembershipObserver = Callable[[str, bool], None]
"""Told of every member that joined (True) or was forgotten (False): (engine id, present)."""


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A model `/v1/models` lists."""

    id: str
    created: int  # the earliest start of its engines' processes (0: none known)
    max_model_len: int | None


class Fleet:
    """The engines of one router, indexed by id."""

    def __init__(
        self,
        engines: Iterable[EngineConfig],
        clock: Clock,
        policy: Policy | None = None,
        in_flight: InFlightCounts | None = None,
    ) -> None:
        self._engines = {e.id: EngineState(config=e, role=e.role) for e in engines}
        self._clock = clock
        self.policy = policy or Policy()
        self.in_flight: InFlightCounts = in_flight or InFlight(self._engines)
        self._observers: list[Observer] = []
        self._membership_observers: list[MembershipObserver] = []
        self.counters = Counters()

    def __iter__(self) -> Iterator[EngineState]:
        return iter(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    def get(self, engine_id: str) -> EngineState:
        return self._engines[engine_id]

    def find(self, engine_id: str) -> EngineState | None:
        """The engine, or None once it left the fleet (a leg may outlive its engine)."""
        return self._engines.get(engine_id)

    def has(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def add(self, config: EngineConfig, reason: str, origin: str) -> EngineState:
        """A new member (DESIGN §10): unverified, so never a candidate until its first
        healthy answer."""
        if config.id in self._engines:
            raise ValueError(f"engine {config.id!r} is already in the fleet")
        state = EngineState(config=config, role=config.role, origin=origin)
        self._engines[config.id] = state
        self.in_flight.add(config.id)
        log.info(
            "engine %s: absent -> %s (%s)",
            config.id,
            state.status(self._clock.monotonic()),
            reason,
            extra={"engine": config.id, "from": "absent", "to": "unverified", "reason": reason},
        )
        for observer in self._membership_observers:
            observer(config.id, True)
        return state

    def forget(self, engine_id: str, reason: str) -> None:
        """Remove a member and its durable counters. Its in-flight requests, if any, end on
        their own; what they report about it is ignored (`has` is False)."""
        state = self._engines.pop(engine_id)
        self.in_flight.remove(engine_id)
        self.counters.forget(engine_id)
        old = state.status(self._clock.monotonic())
        log.info(
            "engine %s: %s -> absent (%s)",
            engine_id,
            old,
            reason,
            extra={"engine": engine_id, "from": old, "to": "absent", "reason": reason},
        )
        for observer in self._membership_observers:
            observer(engine_id, False)

    def observe(self, observer: Observer) -> None:
        self._observers.append(observer)

    def observe_membership(self, observer: MembershipObserver) -> None:
        self._membership_observers.append(observer)

    def apply(self, event: Event, now: float) -> tuple[SuspectProbe, ...]:
        """Apply one event at monotonic `now`; return the effects the edge must run. An
        event about an engine no longer in the fleet (a leg that outlived a forced removal)
        changes nothing."""
        before = self._engines.get(event.engine_id)
        if before is None:
            return ()
        step = reduce(before, event, Context(now, self._clock.wall(), self.policy))
        after = step.state
        if isinstance(event, LegFailed):
            self.counters.failures[(before.id, event.failure_class.value)] += 1
        if after is before:
            return step.effects
        self._engines[before.id] = after
        if before.ejected is None and after.ejected is not None:
            self.counters.ejections[before.id] += 1
        if isinstance(event, Readmitted):
            self.counters.readmissions[before.id] += 1
        if step.reason is not None:
            old, new = before.status(now), after.status(now)
            log.info(
                "engine %s: %s -> %s (%s)",
                before.id,
                old,
                new,
                step.reason,
                extra={"engine": before.id, "from": old, "to": new, "reason": step.reason},
            )
        for observer in self._observers:
            observer(before, after, event, step)
        return step.effects

    def candidates(self, role: Role, now: float, model: str | None = None) -> list[Candidate]:
        """Engines that may take new work for `role` (and `model`: capacity and last-engine
        protection are per model), with last-engine protection.

        Soft holds (drift, quarantine) are honoured only while another engine of the role
        remains eligible; an expired hold no longer counts (no monitor pass needed). An
        unverified engine is never a candidate, last engine or not.
        """
        base = [
            e
            for e in self._engines.values()
            if e.serves(role)
            and e.serves_model(model)
            and e.verified
            and e.ejected is None
            and e.leaving is None
            and (not e.holds or not any(h.name not in SOFT_HOLDS for h in e.active_holds(now)))
        ]
        # Most engines have no hold at all: no list built for them on each request.
        free = [e for e in base if not e.holds or not e.active_holds(now)]
        chosen = free or base
        return [Candidate(e.id, self.in_flight.of(e.id)) for e in chosen]

    def verification_peers(
        self, role: Role, now: float, model: str | None = None
    ) -> list[EngineState]:
        """Engines of `role` kept out only by an `inference_verification` hold (and soft
        holds): the stand-in peers of an inference probe when no engine is eligible."""
        return [
            e
            for e in self._engines.values()
            if e.serves(role)
            and e.serves_model(model)
            and e.verified
            and e.ejected is None
            and e.leaving is None
            and {h.name for h in e.active_holds(now) if h.name not in SOFT_HOLDS}
            == {HoldName.INFERENCE_VERIFICATION}
        ]

    def eligible(self, engine: EngineState, now: float) -> bool:
        return any(
            c.id == engine.id
            for r in self.roles_of(engine)
            for c in self.candidates(r, now, engine.model)
        )

    @staticmethod
    def roles_of(engine: EngineState) -> tuple[Role, ...]:
        return (Role.PREFILL, Role.DECODE) if engine.role is Role.BOTH else (engine.role,)

    def needed_roles(self, model: str | None = None) -> tuple[Role, ...]:
        """Roles a request needs: both legs for a PD fleet, one for a unified fleet or an
        embeddings model (of `model`'s engines, when given)."""
        engines = [e for e in self._engines.values() if e.serves_model(model)]
        if engines and all(e.role is Role.EMBED for e in engines):
            return (Role.EMBED,)
        generative = [e for e in engines if e.role is not Role.EMBED]
        if generative and all(e.role is Role.BOTH for e in generative):
            return (Role.BOTH,)
        return (Role.PREFILL, Role.DECODE)

    def has_verified(self, role: Role, model: str | None = None) -> bool:
        """Whether any engine serving `role` (and `model`) has been verified, ejected or not."""
        return any(
            e.verified and e.serves(role) and e.serves_model(model) for e in self._engines.values()
        )

    def roles_without_verified(self, model: str | None = None) -> list[Role]:
        """Needed roles that no verified engine serves yet: `/ready` says `starting` for
        them (an ejected engine that was verified still counts: that is lost capacity)."""
        return [r for r in self.needed_roles(model) if not self.has_verified(r, model)]

    def models(self) -> list[str]:
        """The models the members must serve (DESIGN §10), in order."""
        return sorted({e.model for e in self._engines.values() if e.leaving is None and e.model})

    def knows_model(self, model: str) -> bool:
        """Whether any member serves `model` (its own, or an adapter it reported)."""
        return any(e.serves_model(model) for e in self._engines.values())

    def servable_models(self, now: float) -> list[ModelCard]:
        """Models with capacity now: an eligible engine for every role they need (their
        LoRA adapters included), for `/v1/models`: each with the earliest start of its
        engines' processes (their generation, when known) and the smallest context."""
        names = {e.model for e in self._engines.values() if e.model}
        names |= {m for e in self._engines.values() for m in e.served}
        cards = []
        for model in sorted(names):
            picked = [self.candidates(r, now, model) for r in self.needed_roles(model)]
            if not all(picked):
                continue
            engines = [self._engines[c.id] for cs in picked for c in cs]
            starts = [e.generation for e in engines if e.generation is not None]
            limits = [e.max_model_len for e in engines if e.max_model_len is not None]
            cards.append(
                ModelCard(model, int(min(starts)) if starts else 0, min(limits, default=None))
            )
        return cards
