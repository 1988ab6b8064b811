"""Test set-up for fleets built without running a router (DESIGN §10)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

from narwhal.control.engine_tasks import EngineTasks
from narwhal.control.evidence import EvidenceRecorder
from narwhal.engine.failures import FailureClass
from narwhal.fleet.events import Event, LegFailed, SuspectProbe, VerificationSeen
from narwhal.fleet.holds import HoldName
from narwhal.fleet.reducer import Action, Step
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet

ActionRecord = tuple[str, FailureClass, Action, str]


def verify_all(fleet: Fleet) -> Fleet:
    """Mark every engine verified, as a fleet already seen healthy with the right model: for
    tests about a serving fleet that build it directly, with no health sweep to verify it."""
    for engine in fleet:
        fleet.apply(VerificationSeen(engine.id, True, "verified by the test"), 0.0)
    return fleet


def record_actions(fleet: Fleet, recorder: EvidenceRecorder) -> list[ActionRecord]:
    """The failure table's actions as they happen, (engine, class, action, detail): an
    ejection or an inference-verification hold caused by a leg failure, or a suspect probe
    the reducer asked for."""
    actions: list[ActionRecord] = []
    details: dict[str, str] = {}

    def observe(before: EngineState, after: EngineState, event: Event, step: Step) -> None:
        if not isinstance(event, LegFailed):
            return
        details[after.id] = event.detail
        if before.ejected is None and after.ejected is not None:
            actions.append((after.id, event.failure_class, Action.EJECT, event.detail))
        elif HoldName.INFERENCE_VERIFICATION in set(after.holds) - set(before.holds):
            actions.append((after.id, event.failure_class, Action.HOLD_AND_PROBE, event.detail))

    def probe(effect: SuspectProbe) -> None:
        detail = details.get(effect.engine_id, "")
        actions.append((effect.engine_id, effect.failure_class, Action.HEALTH_PROBE, detail))

    fleet.observe(observe)
    recorder.on_effect(probe)
    return actions


def set_in_flight(fleet: Fleet, engine_id: str, count: int) -> None:
    """Requests in flight on an engine as the data plane would count them."""
    while fleet.in_flight.of(engine_id) < count:
        fleet.in_flight.enter(engine_id)
    while fleet.in_flight.of(engine_id) > count:
        fleet.in_flight.leave(engine_id)


def force_state(fleet: Fleet, engine_id: str, **changes: Any) -> None:
    """Set an engine's state past the reducer, for a situation no event produces (such as
    forgetting a learned limit); everything else in tests goes through `Fleet.apply`."""
    fleet._engines[engine_id] = replace(fleet.get(engine_id), **changes)


def collecting_tasks(started: list[asyncio.Task[None]]) -> EngineTasks:
    """Engine tasks as real tasks, also kept in `started` for the test to await (one per
    engine and kind at a time, as in the router)."""

    def spawn(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        started.append(task)
        return task

    return EngineTasks(spawn)
