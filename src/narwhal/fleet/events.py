"""Everything that may change an engine's state, as typed, immutable events.

The data plane, the monitor stages, probes, readmission, operator actions and the handoff
send these to `Fleet.apply`; none of them changes an `EngineState` itself. `Effect`s are what
the reducer asks the edge to do in return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from narwhal.config import EngineConfig, Role
from narwhal.engine.failures import FailureClass, SuccessKind
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.state import Ejection


@dataclass(frozen=True, slots=True)
class LegFailed:
    """A classified failure of one leg, health check or probe: one more in its class's streak."""

    engine_id: str
    failure_class: FailureClass
    detail: str
    leg: str


@dataclass(frozen=True, slots=True)
class LegSucceeded:
    """A success that clears what the spec's clearing table says for its kind."""

    engine_id: str
    kind: SuccessKind
    leg: str


@dataclass(frozen=True, slots=True)
class HealthOk:
    """A health 200: clears what it clears, resets liveness, and ends a failure quarantine
    (never an operator drain)."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class LivenessSwept:
    """One health sweep's verdict on liveness: `silent` (no answer at all) or answered."""

    engine_id: str
    silent: bool


@dataclass(frozen=True, slots=True)
class VerificationSeen:
    """One look at an unverified engine: `ok` verifies it, otherwise `reason` says why not."""

    engine_id: str
    ok: bool
    reason: str
    models: tuple[str, ...] = ()  # what the engine reported serving, when known
    adapters: tuple[str, ...] = ()  # those of `models` that are LoRA adapters


@dataclass(frozen=True, slots=True)
class EjectRequested:
    """A confirmed failure (a failed suspect or inference probe): out of placement."""

    engine_id: str
    cause: str
    reason: str


@dataclass(frozen=True, slots=True)
class HoldRequested:
    """Place a hold (unless the same one is already active); `duration_s` makes it temporary,
    `newer_than` is planned maintenance's generation baseline."""

    engine_id: str
    name: HoldName
    reason: str
    duration_s: float | None = None
    newer_than: float | None = None


@dataclass(frozen=True, slots=True)
class HoldReleased:
    engine_id: str
    name: HoldName
    reason: str


@dataclass(frozen=True, slots=True)
class HoldsExpired:
    """Drop holds whose deadline passed (placement already ignores them)."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class InferenceVerified:
    """An inference probe passed: clears inference evidence, verification and quarantine."""

    engine_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Readmitted:
    """Verification passed: back in placement, evidence cleared. Only an operator's
    readmission also clears an operator drain."""

    engine_id: str
    reason: str
    operator: bool = False


@dataclass(frozen=True, slots=True)
class GenerationSeen:
    """A process generation read from the engine; only a newer one is kept."""

    engine_id: str
    generation: float


@dataclass(frozen=True, slots=True)
class ModelLimitLearned:
    """The engine's `max_model_len`, learned once."""

    engine_id: str
    max_model_len: int


@dataclass(frozen=True, slots=True)
class RoleChanged:
    """A verified rebalancing move of a `kv_both` engine."""

    engine_id: str
    role: Role
    reason: str


@dataclass(frozen=True, slots=True)
class Leaving:
    """Removed from the fleet: no new work from now on (DESIGN §10). Never ejected or charged
    for it; the store forgets the engine once its requests settle."""

    engine_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Relocated:
    """The same engine id at a new address (a rescheduled pod, an edited config): a new
    process, unverified until it answers, with its evidence and generation started afresh.
    Holds and an ejection stay: what the operator or the failure decided still stands."""

    engine_id: str
    config: EngineConfig
    reason: str


@dataclass(frozen=True, slots=True)
class Restored:
    """An engine's saved state from a handoff (a `--resume`, or a standby following)."""

    engine_id: str
    role: Role
    generation: float | None
    max_model_len: int | None
    ejected: Ejection | None
    holds: Mapping[HoldName, Hold]
    verified: bool
    served: frozenset[str] | None = None  # None: not in the document (an older router)
    adapters: frozenset[str] | None = None


Event = (
    LegFailed
    | LegSucceeded
    | HealthOk
    | LivenessSwept
    | VerificationSeen
    | EjectRequested
    | HoldRequested
    | HoldReleased
    | HoldsExpired
    | InferenceVerified
    | Readmitted
    | GenerationSeen
    | ModelLimitLearned
    | RoleChanged
    | Leaving
    | Relocated
    | Restored
)


@dataclass(frozen=True, slots=True)
class SuspectProbe:
    """Effect: a timeout or overload streak asks for a health probe, which confirms (ejects)
    or clears it."""

    engine_id: str
    failure_class: FailureClass


Effect = SuspectProbe
