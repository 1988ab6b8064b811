"""The one function that changes engine state: `reduce(engine, event, ctx) -> Step`.

Pure: it takes the engine's current immutable state, an event, and the moment (`ctx`), and
returns the new state, the reason to log (None for silent bookkeeping such as a streak or a
liveness count), and the effects the edge must run. The spec's failure table (`action_for`)
and clearing table (`CLEARS`) are applied here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from narwhal.config import RecoveryConfig
from narwhal.engine.failures import CLEARS, INFERENCE_CLASSES, FailureClass, SuccessKind
from narwhal.fleet.events import (
    EjectRequested,
    Event,
    GenerationSeen,
    HealthOk,
    HoldReleased,
    HoldRequested,
    HoldsExpired,
    InferenceVerified,
    Leaving,
    LegFailed,
    LegSucceeded,
    LivenessSwept,
    ModelLimitLearned,
    Readmitted,
    Relocated,
    Restored,
    RoleChanged,
    SuspectProbe,
    VerificationSeen,
)
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.state import NOT_YET_SEEN, Ejection, EngineState


class Action(StrEnum):
    NONE = "none"
    EJECT = "eject"
    HEALTH_PROBE = "health_probe"
    HOLD_AND_PROBE = "hold_and_probe"


def action_for(failure_class: FailureClass, streak: int, eject_after: int) -> Action:
    """The spec's failure table: what a streak of `streak` failures of a class calls for."""
    if streak < eject_after:
        return Action.NONE
    if failure_class is FailureClass.CONNECTION:
        return Action.EJECT
    if failure_class in (FailureClass.TIMEOUT, FailureClass.OVERLOAD):
        return Action.HEALTH_PROBE
    assert failure_class in INFERENCE_CLASSES
    return Action.HOLD_AND_PROBE


@dataclass(frozen=True, slots=True)
class Policy:
    """The recovery settings the reducer applies (`recovery.*`)."""

    eject_after: int = 3
    liveness_misses: int = 3
    failure_quarantine_s: float | None = None

    @classmethod
    def of(cls, recovery: RecoveryConfig) -> Policy:
        return cls(recovery.eject_after, recovery.liveness_misses, recovery.failure_quarantine_s)


@dataclass(frozen=True, slots=True)
class Context:
    """The moment an event is applied, on both clocks, and the policy in force."""

    now: float  # monotonic: hold deadlines
    wall: float  # wall: what documents and the admin API show
    policy: Policy


@dataclass(frozen=True, slots=True)
class Step:
    """What one event did: the new state (the same object when nothing changed), the
    transition reason to log (None: a silent change), and the effects to run."""

    state: EngineState
    reason: str | None = None
    effects: tuple[SuspectProbe, ...] = ()


_CLEARED_BY_READMISSION = (
    HoldName.PLANNED_MAINTENANCE,
    HoldName.INFERENCE_VERIFICATION,
    HoldName.FAILURE_QUARANTINE,
)


_NOT_FOR_LEAVERS = (LegFailed, LivenessSwept, EjectRequested)


def reduce(engine: EngineState, event: Event, ctx: Context) -> Step:
    """Apply one event to one engine."""
    if engine.leaving is not None and isinstance(event, _NOT_FOR_LEAVERS):
        return Step(engine)  # never ejected or charged for leaving (DESIGN §10)
    match event:
        case LegSucceeded(kind=kind):
            return Step(_clear(engine, CLEARS[kind]))
        case LegFailed():
            return _failed(engine, event, ctx)
        case HealthOk():
            cleared = _clear(engine, CLEARS[SuccessKind.HEALTH_OK])
            if cleared.liveness_misses:
                cleared = replace(cleared, liveness_misses=0)
            return _release(cleared, HoldName.FAILURE_QUARANTINE, "health 200")
        case LivenessSwept(silent=silent):
            return _liveness(engine, silent, ctx)
        case VerificationSeen(ok=ok, reason=reason, models=models, adapters=adapters):
            served = frozenset(models) if ok and models else engine.served
            lora = frozenset(adapters) if ok and models else engine.adapters
            if engine.verified or (not ok and engine.unverified_reason == reason):
                if served == engine.served and lora == engine.adapters:
                    return Step(engine)
                return Step(replace(engine, served=served, adapters=lora))
            label = "verified" if ok else "not verified"
            new = replace(
                engine,
                verified=ok,
                unverified_reason=None if ok else reason,
                served=served,
                adapters=lora,
            )
            return Step(new, f"{label}: {reason}")
        case EjectRequested(cause=cause, reason=reason):
            return _eject(engine, cause, reason, ctx)
        case HoldRequested():
            return _hold(engine, event, ctx)
        case HoldReleased(name=name, reason=reason):
            return _release(engine, name, reason)
        case HoldsExpired():
            expired = [h for h in engine.holds.values() if h.expired(ctx.now)]
            if not expired:
                return Step(engine)
            holds = {n: h for n, h in engine.holds.items() if not h.expired(ctx.now)}
            names = ", ".join(h.name.value for h in expired)
            return Step(replace(engine, holds=holds), f"release {names}: deadline passed")
        case InferenceVerified(reason=reason):
            new = _clear(engine, INFERENCE_CLASSES)
            return _release_all(
                new, (HoldName.INFERENCE_VERIFICATION, HoldName.FAILURE_QUARANTINE), reason
            )
        case Readmitted(reason=reason, operator=operator):
            lifted = (
                (*_CLEARED_BY_READMISSION, HoldName.OPERATOR_DRAIN)
                if operator
                else _CLEARED_BY_READMISSION
            )
            holds = {n: h for n, h in engine.holds.items() if n not in lifted}
            new = replace(
                engine,
                ejected=None,
                evidence={},
                liveness_misses=0,
                verified=True,
                unverified_reason=None,
                holds=holds,
            )
            return Step(new, f"readmitted: {reason}")
        case GenerationSeen(generation=generation):
            if engine.generation is not None and generation <= engine.generation:
                return Step(engine)
            return Step(replace(engine, generation=generation))
        case ModelLimitLearned(max_model_len=limit):
            if engine.max_model_len is not None:
                return Step(engine)
            return Step(replace(engine, max_model_len=limit))
        case RoleChanged(role=role, reason=reason):
            if role is engine.role:
                return Step(engine)
            return Step(
                replace(engine, role=role),
                f"role {engine.role.value} -> {role.value} (rebalanced: {reason})",
            )
        case Leaving(reason=reason):
            if engine.leaving is not None:
                return Step(engine)
            return Step(replace(engine, leaving=reason), f"leaving: {reason}")
        case Relocated(config=config, reason=reason):
            if config == engine.config:
                return Step(engine)
            new = replace(
                engine,
                config=config,
                evidence={},
                liveness_misses=0,
                generation=None,
                verified=False,
                unverified_reason=NOT_YET_SEEN,
            )
            return Step(new, f"relocated to {config.url}: {reason}")
        case Restored():
            return _restored(engine, event)


def _clear(engine: EngineState, classes: frozenset[FailureClass]) -> EngineState:
    """The engine without the streaks of `classes` (the same object if it had none: the
    hot path of every successful leg allocates nothing)."""
    if not engine.evidence or classes.isdisjoint(engine.evidence):
        return engine
    return replace(engine, evidence={c: n for c, n in engine.evidence.items() if c not in classes})


def _failed(engine: EngineState, event: LegFailed, ctx: Context) -> Step:
    """One more failure of a class, and what the failure table says a full streak calls for.
    A quarantine (when configured) comes with every threshold action; ejection brings its own."""
    cls = event.failure_class
    streak = engine.evidence.get(cls, 0) + 1
    new = replace(engine, evidence={**engine.evidence, cls: streak})
    action = action_for(cls, streak, ctx.policy.eject_after)
    if action is Action.NONE:
        return Step(new)
    why = f"{cls.value} streak: {event.detail}"
    if action is Action.EJECT:
        return _eject(new, cls.value, why, ctx)
    reasons: list[str] = []
    quarantine_s = ctx.policy.failure_quarantine_s
    if quarantine_s is not None:
        new = _with_hold(
            new,
            HoldRequested(engine.id, HoldName.FAILURE_QUARANTINE, why, duration_s=quarantine_s),
            ctx,
            reasons,
        )
    if action is Action.HOLD_AND_PROBE:
        new = _with_hold(
            new, HoldRequested(engine.id, HoldName.INFERENCE_VERIFICATION, why), ctx, reasons
        )
        return Step(new, "; ".join(reasons) or None)
    return Step(new, "; ".join(reasons) or None, (SuspectProbe(engine.id, cls),))


def _liveness(engine: EngineState, silent: bool, ctx: Context) -> Step:
    if engine.ejected is not None:
        return Step(engine)
    if not silent:
        return Step(engine if engine.liveness_misses == 0 else replace(engine, liveness_misses=0))
    misses = engine.liveness_misses + 1
    new = replace(engine, liveness_misses=misses)
    if misses >= ctx.policy.liveness_misses:
        return _eject(new, "liveness", f"{misses} silent health sweeps", ctx)
    return Step(new)


def _eject(engine: EngineState, cause: str, reason: str, ctx: Context) -> Step:
    """Out of placement (a confirmed failure: no last-engine protection), with a failure
    quarantine when one is configured. An engine already ejected keeps its first record."""
    if engine.ejected is not None:
        return Step(engine)
    record = Ejection(cause, reason, ctx.wall, {k.value: v for k, v in engine.evidence.items()})
    new = replace(engine, ejected=record)
    quarantine_s = ctx.policy.failure_quarantine_s
    if quarantine_s is not None:
        hold = _temporary(HoldName.FAILURE_QUARANTINE, f"{cause}: {reason}", ctx, quarantine_s)
        new = replace(new, holds={**new.holds, HoldName.FAILURE_QUARANTINE: hold})
    return Step(new, f"ejected: {cause}: {reason}")


def _temporary(name: HoldName, reason: str, ctx: Context, duration_s: float) -> Hold:
    return Hold(
        name,
        reason,
        ctx.wall,
        deadline_mono=ctx.now + duration_s,
        deadline_wall=ctx.wall + duration_s,
    )


def _with_hold(
    engine: EngineState, event: HoldRequested, ctx: Context, reasons: list[str]
) -> EngineState:
    """The engine with the hold placed, unless the same hold is active already; the
    transition reason is appended to `reasons`."""
    current = engine.holds.get(event.name)
    if current is not None and not current.expired(ctx.now):
        return engine
    hold = (
        _temporary(event.name, event.reason, ctx, event.duration_s)
        if event.duration_s is not None
        else Hold(event.name, event.reason, ctx.wall, newer_than=event.newer_than)
    )
    reasons.append(f"hold {event.name.value}: {event.reason}")
    return replace(engine, holds={**engine.holds, event.name: hold})


def _hold(engine: EngineState, event: HoldRequested, ctx: Context) -> Step:
    reasons: list[str] = []
    new = _with_hold(engine, event, ctx, reasons)
    return Step(new, reasons[0] if reasons else None)


def _release(engine: EngineState, name: HoldName, reason: str) -> Step:
    return _release_all(engine, (name,), reason)


def _release_all(engine: EngineState, names: tuple[HoldName, ...], reason: str) -> Step:
    present = [n for n in names if n in engine.holds]
    if not present:
        return Step(engine)
    holds = {n: h for n, h in engine.holds.items() if n not in present}
    label = ", ".join(n.value for n in present)
    return Step(replace(engine, holds=holds), f"release {label}: {reason}")


def _restored(engine: EngineState, event: Restored) -> Step:
    """The saved state; a change is a logged transition, while re-applying what is already
    there (a standby following every write) stays silent."""

    def saved_view(h: Hold) -> tuple[object, ...]:  # what the document keeps of a hold
        return (h.reason, h.since_wall, h.deadline_wall, h.newer_than)

    verified = event.verified
    reason = engine.unverified_reason
    if engine.verified != verified:
        reason = None if verified else f"{NOT_YET_SEEN} (restored unverified)"
    new = replace(
        engine,
        role=event.role,
        generation=event.generation,
        max_model_len=(
            event.max_model_len if event.max_model_len is not None else engine.max_model_len
        ),
        ejected=event.ejected,
        holds=dict(event.holds),
        verified=verified,
        unverified_reason=reason,
        served=engine.served if event.served is None else event.served,
        adapters=engine.adapters if event.adapters is None else event.adapters,
    )
    same = (
        engine.verified == verified
        and engine.ejected == event.ejected
        and {n: saved_view(h) for n, h in engine.holds.items()}
        == {n: saved_view(h) for n, h in event.holds.items()}
    )
    return Step(new, None if same else "restored from the handoff document")
