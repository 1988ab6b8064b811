"""What Narwhal knows about one engine, as an immutable record.

An `EngineState` is never changed in place: the reducer returns a new one, and the store
swaps it in, so whatever a reader holds is a consistent snapshot. In-flight counts are not
here: they belong to the data plane (`InFlight`), which the store only reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from narwhal.config import GENERATIVE, EngineConfig, Role
from narwhal.engine.failures import FailureClass
from narwhal.fleet.holds import Hold, HoldName

NOT_YET_SEEN = "not yet seen healthy"


@dataclass(frozen=True, slots=True)
class Ejection:
    """Why and when an engine was taken out of placement."""

    cause: str  # a FailureClass value, or "liveness"
    reason: str
    at_wall: float
    evidence: Mapping[str, int]

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


@dataclass(frozen=True, slots=True)
class EngineState:
    """One engine's control-plane state. The mappings are never mutated: a change is a new
    record (`dataclasses.replace`) made by the reducer.

    An engine starts *unverified* (DESIGN §10): never a candidate until a healthy answer
    naming the configured model verifies it (or a restored handoff says it was verified).
    """

    config: EngineConfig
    role: Role
    evidence: Mapping[FailureClass, int] = field(default_factory=dict)
    liveness_misses: int = 0
    ejected: Ejection | None = None
    holds: Mapping[HoldName, Hold] = field(default_factory=dict)
    generation: float | None = None
    max_model_len: int | None = None
    verified: bool = False
    unverified_reason: str | None = NOT_YET_SEEN  # why not verified yet (None once verified)
    # Removed from the fleet (DESIGN §10): no new work; forgotten once its requests settle.
    leaving: str | None = None
    # Where its membership comes from: `config`, `operator`, `dns` or `file`. Each source
    # adds and removes only its own engines.
    origin: str = "config"
    # Every model the engine reported when it was verified: its own and, on vLLM, the LoRA
    # adapters it serves under their own names (requests for them come here too).
    served: frozenset[str] = frozenset()
    # Those of `served` that are LoRA adapters (`/v1/models` names a `parent`): their KV
    # blocks are keyed by the adapter's name on the engine's model (cache-aware placement).
    adapters: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        return self.config.id

    def serves(self, role: Role) -> bool:
        return self.role is role or (self.role is Role.BOTH and role in GENERATIVE)

    @property
    def model(self) -> str | None:
        """The model the engine must serve (DESIGN §10); the config resolves it."""
        return self.config.model

    def serves_model(self, model: str | None) -> bool:
        """Whether a request for `model` may come here (None: any model)."""
        return model is None or model == self.config.model or model in self.served

    def active_holds(self, now: float) -> list[Hold]:
        return [h for h in self.holds.values() if not h.expired(now)]

    def active_holds_by_name(self, now: float) -> set[HoldName]:
        return {h.name for h in self.active_holds(now)}

    def status(self, now: float) -> str:
        """A one-word summary for transition logs: leaving, ejected, held(...), unverified
        or in-service, the first that applies."""
        if self.leaving is not None:
            return "leaving"
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
