"""The reducer as a pure function: it never changes its input, returns the same record when
nothing changes (a successful leg allocates nothing), and says why when something does."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from narwhal.config import EngineConfig, Role
from narwhal.engine.failures import FailureClass, SuccessKind
from narwhal.fleet.events import (
    EjectRequested,
    Event,
    GenerationSeen,
    HealthOk,
    HoldReleased,
    HoldRequested,
    HoldsExpired,
    InferenceVerified,
    LegFailed,
    LegSucceeded,
    LivenessSwept,
    ModelLimitLearned,
    Readmitted,
    Restored,
    RoleChanged,
    SuspectProbe,
    VerificationSeen,
)
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.reducer import Context, Policy, reduce
from narwhal.fleet.state import EngineState

C = FailureClass
CTX = Context(now=100.0, wall=1_800_000_000.0, policy=Policy(eject_after=2))


def engine(**changes: Any) -> EngineState:
    config = EngineConfig(id="e", url="http://127.0.0.1:9", role=Role.BOTH)
    state = EngineState(config=config, role=Role.BOTH, verified=True, unverified_reason=None)
    return replace(state, **changes)


BUSY = engine(
    evidence={C.TIMEOUT: 1, C.STREAM: 1},
    liveness_misses=1,
    holds={HoldName.PERFORMANCE_DRIFT: Hold(HoldName.PERFORMANCE_DRIFT, "slow", 1.0, 50.0, 2.0)},
    generation=5.0,
)

EVERY_EVENT: list[Event] = [
    LegFailed("e", C.TIMEOUT, "slow", "decode"),
    LegSucceeded("e", SuccessKind.DECODE_DONE, "decode"),
    HealthOk("e"),
    LivenessSwept("e", silent=True),
    LivenessSwept("e", silent=False),
    VerificationSeen("e", True, "ok"),
    EjectRequested("e", "connection", "refused"),
    HoldRequested("e", HoldName.OPERATOR_DRAIN, "operator request"),
    HoldReleased("e", HoldName.PERFORMANCE_DRIFT, "operator"),
    HoldsExpired("e"),
    InferenceVerified("e", "probe passed"),
    Readmitted("e", "verified"),
    GenerationSeen("e", 6.0),
    ModelLimitLearned("e", 4096),
    RoleChanged("e", Role.PREFILL, "rebalanced"),
    Restored("e", Role.BOTH, 5.0, None, None, {}, True),
]


@pytest.mark.parametrize("event", EVERY_EVENT, ids=lambda e: type(e).__name__)
def test_reduce_never_changes_its_input(event: Event) -> None:
    before = copy.deepcopy(BUSY)
    reduce(BUSY, event, CTX)
    assert before == BUSY


@pytest.mark.parametrize(
    "event",
    [
        LegSucceeded("e", SuccessKind.CLIENT_4XX, "decode"),  # nothing it clears is there
        LivenessSwept("e", silent=False),
        VerificationSeen("e", True, "again"),
        HoldReleased("e", HoldName.OPERATOR_DRAIN, "not held"),
        HoldsExpired("e"),
        GenerationSeen("e", 4.0),  # older than the one known
        RoleChanged("e", Role.BOTH, "no move"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_event_that_changes_nothing_returns_the_same_record(event: Event) -> None:
    quiet = engine(generation=5.0)
    step = reduce(quiet, event, CTX)
    assert step.state is quiet and step.reason is None and step.effects == ()


def test_a_full_timeout_streak_asks_for_a_suspect_probe() -> None:
    first = reduce(engine(), LegFailed("e", C.TIMEOUT, "slow", "decode"), CTX)
    assert first.effects == () and first.state.evidence == {C.TIMEOUT: 1}
    second = reduce(first.state, LegFailed("e", C.TIMEOUT, "slow", "decode"), CTX)
    assert second.effects == (SuspectProbe("e", C.TIMEOUT),)
    assert second.reason is None  # no hold without a quarantine configured: nothing to log


def test_a_connection_streak_ejects_with_the_streak_as_evidence() -> None:
    state = reduce(engine(), LegFailed("e", C.CONNECTION, "refused", "prefill"), CTX).state
    step = reduce(state, LegFailed("e", C.CONNECTION, "refused", "prefill"), CTX)
    assert step.state.ejected is not None
    assert step.state.ejected.evidence == {"connection": 2}
    assert step.state.ejected.at_wall == CTX.wall
    assert step.reason == "ejected: connection: connection streak: refused"


def test_holds_expired_drops_only_what_passed_its_deadline() -> None:
    drain = Hold(HoldName.OPERATOR_DRAIN, "operator", 1.0)
    drift = Hold(HoldName.PERFORMANCE_DRIFT, "slow", 1.0, deadline_mono=CTX.now, deadline_wall=2.0)
    held = engine(holds={HoldName.OPERATOR_DRAIN: drain, HoldName.PERFORMANCE_DRIFT: drift})
    step = reduce(held, HoldsExpired("e"), CTX)
    assert step.state.holds == {HoldName.OPERATOR_DRAIN: drain}
    assert step.reason == "release performance_drift: deadline passed"


def test_restoring_what_is_there_is_silent_and_a_change_is_logged() -> None:
    same = Restored("e", Role.BOTH, 5.0, None, None, {}, True)
    assert reduce(engine(), same, CTX).reason is None
    drained = {HoldName.OPERATOR_DRAIN: Hold(HoldName.OPERATOR_DRAIN, "operator", 1.0)}
    step = reduce(engine(), Restored("e", Role.BOTH, 5.0, None, None, drained, True), CTX)
    assert step.reason == "restored from the handoff document"
    assert step.state.holds == drained
