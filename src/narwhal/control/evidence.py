"""Failure evidence: consecutive streaks per engine and class, and what a full streak means.

`action_for` is the spec's failure table as a pure function; `EvidenceRecorder` keeps the
streaks (clearing exactly what the clearing table says) and hands threshold actions to the
control plane, which performs them at the edge.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum

from narwhal.control.fleet import Fleet
from narwhal.control.intervals import IntervalStats
from narwhal.engine.failures import (
    CLEARS,
    INFERENCE_CLASSES,
    EngineFailure,
    FailureClass,
    SuccessKind,
)
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.evidence")


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


def cleared_by(kind: SuccessKind) -> frozenset[FailureClass]:
    return CLEARS[kind]


ActionHandler = Callable[[str, FailureClass, Action, str], None]


class EvidenceRecorder:
    """The evidence sink of the data plane, the health stage and probes."""

    def __init__(
        self, fleet: Fleet, metrics: Metrics, eject_after: int, stats: IntervalStats | None = None
    ) -> None:
        self._stats = stats
        self._fleet = fleet
        self._metrics = metrics
        self._eject_after = eject_after
        self._handlers: list[ActionHandler] = []

    def on_action(self, handler: ActionHandler) -> None:
        self._handlers.append(handler)

    def failure(self, engine_id: str, failure: EngineFailure, leg: str) -> None:
        engine = self._fleet.get(engine_id)
        cls = failure.failure_class
        streak = engine.evidence.get(cls, 0) + 1
        engine.evidence[cls] = streak
        self._metrics.failures.labels(engine_id, cls.value).inc()
        self._fleet.counters.failures[(engine_id, cls.value)] += 1
        if self._stats is not None:
            self._stats.failure(engine_id, cls.value)
        self._metrics.evidence_streak.labels(engine_id, cls.value).set(streak)
        action = action_for(cls, streak, self._eject_after)
        log.debug(
            "engine %s %s failure on %s leg (%s), streak %d",
            engine_id,
            cls.value,
            leg,
            failure.detail,
            streak,
        )
        if action is not Action.NONE:
            for handler in self._handlers:
                handler(engine_id, cls, action, failure.detail)

    def success(self, engine_id: str, kind: SuccessKind, leg: str) -> None:
        engine = self._fleet.get(engine_id)
        for cls in CLEARS[kind]:
            if engine.evidence.pop(cls, None) is not None:
                self._metrics.evidence_streak.labels(engine_id, cls.value).set(0)

    def clear(self, engine_id: str, classes: frozenset[FailureClass]) -> None:
        engine = self._fleet.get(engine_id)
        for cls in classes:
            if engine.evidence.pop(cls, None) is not None:
                self._metrics.evidence_streak.labels(engine_id, cls.value).set(0)
