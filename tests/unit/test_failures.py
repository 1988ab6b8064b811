"""The failure taxonomy against the spec ("Failure evidence", "Clearing failure evidence")."""

from __future__ import annotations

import pytest

from narwhal.clock import FakeClock
from narwhal.config import EngineConfig, Role
from narwhal.control.evidence import EvidenceRecorder
from narwhal.engine.failures import (
    CLEARS,
    INFERENCE_CLASSES,
    EngineFailure,
    FailureClass,
    SuccessKind,
    classify_status,
)
from narwhal.fleet.events import Event, LegFailed, SuspectProbe
from narwhal.fleet.holds import HoldName
from narwhal.fleet.reducer import Action, Policy, Step, action_for
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet

F = FailureClass

# --------------------------------------------------------------------------- statuses

STATUSES: list[tuple[int, FailureClass | None]] = [
    (408, F.OVERLOAD),
    (429, F.OVERLOAD),
    (400, None),
    (401, None),
    (403, None),
    (404, None),
    (405, None),
    (409, None),
    (413, None),
    (422, None),
    (499, None),
    (500, F.INFERENCE_STATUS),
    (501, F.INFERENCE_STATUS),
    (502, F.INFERENCE_STATUS),
    (503, F.INFERENCE_STATUS),
    (504, F.INFERENCE_STATUS),
    (507, F.INFERENCE_STATUS),
    (599, F.INFERENCE_STATUS),
]


@pytest.mark.parametrize(("status", "expected"), STATUSES, ids=[str(s) for s, _ in STATUSES])
def test_classify_status(status: int, expected: FailureClass | None) -> None:
    assert classify_status(status) is expected


def test_every_4xx_but_408_429_is_the_clients() -> None:
    for status in range(400, 500):
        expected = F.OVERLOAD if status in (408, 429) else None
        assert classify_status(status) is expected, status


def test_every_5xx_is_inference_status() -> None:
    assert all(classify_status(s) is F.INFERENCE_STATUS for s in range(500, 600))


# --------------------------------------------------------------------------- clearing table

# The spec's "Clearing failure evidence" table, verbatim (liveness is a separate counter).
SPEC_CLEARS: list[tuple[str, SuccessKind, frozenset[FailureClass]]] = [
    (
        "4xx-other-than-408-429",
        SuccessKind.CLIENT_4XX,
        frozenset({F.CONNECTION, F.INFERENCE_STATUS}),
    ),
    ("health-200", SuccessKind.HEALTH_OK, frozenset({F.CONNECTION, F.TIMEOUT, F.OVERLOAD})),
    (
        "prefill-with-handoff",
        SuccessKind.PREFILL_HANDOFF,
        frozenset({F.CONNECTION, F.INFERENCE_STATUS, F.KV_HANDOFF}),
    ),
    (
        "decode-terminal-marker",
        SuccessKind.DECODE_DONE,
        frozenset({F.CONNECTION, F.INFERENCE_STATUS, F.STREAM}),
    ),
]


@pytest.mark.parametrize(
    ("kind", "expected"), [c[1:] for c in SPEC_CLEARS], ids=[c[0] for c in SPEC_CLEARS]
)
def test_clears_matches_the_spec_row(kind: SuccessKind, expected: frozenset[FailureClass]) -> None:
    assert CLEARS[kind] == expected


def test_clears_has_only_the_spec_rows_the_finished_prefill_and_embeddings() -> None:
    extra = {SuccessKind.PREFILL_FINISHED, SuccessKind.EMBEDDED}
    assert set(CLEARS) == {kind for _, kind, _ in SPEC_CLEARS} | extra
    assert set(CLEARS) == set(SuccessKind)


def test_an_embeddings_answer_clears_what_any_client_visible_success_clears() -> None:
    # Not a spec row: a whole 200 with no stream or handoff in it, like a finished prefill.
    assert CLEARS[SuccessKind.EMBEDDED] == CLEARS[SuccessKind.PREFILL_FINISHED]


def test_finished_prefill_clears_no_more_than_a_prefill_with_handoff() -> None:
    # Not a spec row: a 2xx prefill without a handoff must never clear kv_handoff evidence.
    finished = CLEARS[SuccessKind.PREFILL_FINISHED]
    assert finished <= CLEARS[SuccessKind.PREFILL_HANDOFF]
    assert F.KV_HANDOFF not in finished


def test_only_health_clears_timeout_and_overload() -> None:
    for kind, classes in CLEARS.items():
        if kind is not SuccessKind.HEALTH_OK:
            assert F.TIMEOUT not in classes, kind
            assert F.OVERLOAD not in classes, kind


# --------------------------------------------------------------------------- failure table

SPEC_ACTIONS: list[tuple[FailureClass, Action]] = [
    (F.CONNECTION, Action.EJECT),
    (F.TIMEOUT, Action.HEALTH_PROBE),
    (F.STREAM, Action.HOLD_AND_PROBE),
    (F.OVERLOAD, Action.HEALTH_PROBE),
    (F.INFERENCE_STATUS, Action.HOLD_AND_PROBE),
    (F.KV_HANDOFF, Action.HOLD_AND_PROBE),
]


def test_failure_table_covers_every_class() -> None:
    assert {cls for cls, _ in SPEC_ACTIONS} == set(FailureClass)


def test_inference_classes_are_the_hold_and_probe_rows() -> None:
    assert {cls for cls, a in SPEC_ACTIONS if a is Action.HOLD_AND_PROBE} == INFERENCE_CLASSES


@pytest.mark.parametrize("eject_after", [1, 3, 10])
@pytest.mark.parametrize(("cls", "action"), SPEC_ACTIONS, ids=[c.value for c, _ in SPEC_ACTIONS])
def test_action_for(cls: FailureClass, action: Action, eject_after: int) -> None:
    for streak in range(eject_after):
        assert action_for(cls, streak, eject_after) is Action.NONE, streak
    assert action_for(cls, eject_after, eject_after) is action
    assert action_for(cls, eject_after + 1, eject_after) is action
    assert action_for(cls, eject_after + 100, eject_after) is action


# --------------------------------------------------------------------------- the recorder


def _recorder(eject_after: int = 3) -> tuple[Fleet, EvidenceRecorder, list[tuple[str, F, Action]]]:
    """A fleet and its recorder; `fired` lists the failure table's actions as they happen:
    an ejection, an inference-verification hold, or a suspect probe asked for."""
    clock = FakeClock()
    fleet = Fleet(
        [
            EngineConfig(id="p0", url="http://127.0.0.1:9001", role=Role.PREFILL),
            EngineConfig(id="d0", url="http://127.0.0.1:9101", role=Role.DECODE),
        ],
        clock,
        Policy(eject_after=eject_after),
    )
    recorder = EvidenceRecorder(fleet, clock)
    fired: list[tuple[str, F, Action]] = []

    def probe(effect: SuspectProbe) -> None:
        fired.append((effect.engine_id, effect.failure_class, Action.HEALTH_PROBE))

    def observe(before: EngineState, after: EngineState, event: Event, step: Step) -> None:
        if not isinstance(event, LegFailed):
            return
        if before.ejected is None and after.ejected is not None:
            fired.append((after.id, event.failure_class, Action.EJECT))
        elif HoldName.INFERENCE_VERIFICATION in set(after.holds) - set(before.holds):
            fired.append((after.id, event.failure_class, Action.HOLD_AND_PROBE))

    recorder.on_effect(probe)
    fleet.observe(observe)
    return fleet, recorder, fired


@pytest.mark.parametrize(("cls", "action"), SPEC_ACTIONS, ids=[c.value for c, _ in SPEC_ACTIONS])
def test_recorder_acts_exactly_at_eject_after(cls: FailureClass, action: Action) -> None:
    fleet, recorder, fired = _recorder(eject_after=3)
    for _ in range(2):
        recorder.failure("p0", EngineFailure(cls, "boom"), "prefill")
    assert fired == []
    assert fleet.get("p0").evidence == {cls: 2}
    recorder.failure("p0", EngineFailure(cls, "boom"), "prefill")
    assert fired == [("p0", cls, action)]
    assert fleet.get("d0").evidence == {}


@pytest.mark.parametrize(
    ("kind", "cleared"), [c[1:] for c in SPEC_CLEARS], ids=[c[0] for c in SPEC_CLEARS]
)
def test_recorder_success_clears_exactly_the_table(
    kind: SuccessKind, cleared: frozenset[FailureClass]
) -> None:
    fleet, recorder, _ = _recorder(eject_after=100)
    for cls in FailureClass:
        recorder.failure("d0", EngineFailure(cls, "x"), "decode")
    recorder.success("d0", kind, "decode")
    assert set(fleet.get("d0").evidence) == set(FailureClass) - cleared
    assert all(streak == 1 for streak in fleet.get("d0").evidence.values())


def test_streaks_are_per_class_and_a_clear_restarts_them() -> None:
    _, recorder, fired = _recorder(eject_after=2)
    recorder.failure("p0", EngineFailure(F.CONNECTION, "refused"), "prefill")
    recorder.failure("p0", EngineFailure(F.TIMEOUT, "slow"), "prefill")
    assert fired == []  # one of each class is not a streak of two
    recorder.success("p0", SuccessKind.CLIENT_4XX, "prefill")  # clears connection only
    recorder.failure("p0", EngineFailure(F.CONNECTION, "refused"), "prefill")
    assert fired == []
    recorder.failure("p0", EngineFailure(F.TIMEOUT, "slow"), "prefill")
    assert fired == [("p0", F.TIMEOUT, Action.HEALTH_PROBE)]


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        # vLLM's 500 for a prompt over the model's length (the simulator's words too)
        (500, b'{"error": {"message": "The decoder prompt (length 5000) is longer than the '
              b'maximum model length of 4096."}}', None),
        (500, b'{"object": "error", "message": "This model\'s maximum context length is 4096 '
              b'tokens. However, you requested 5004 tokens"}', None),
        (500, b'{"error": {"message": "CUDA error: an illegal memory access"}}',
         F.INFERENCE_STATUS),
        (500, b"", F.INFERENCE_STATUS),
        (503, b"is longer than the maximum model length", F.INFERENCE_STATUS),  # only a 500
        (400, b"anything", None),
    ],
)  # fmt: skip
def test_a_500_for_a_prompt_too_long_is_the_clients(
    status: int, body: bytes, expected: FailureClass | None
) -> None:
    assert classify_status(status, body) is expected
