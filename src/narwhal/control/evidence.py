"""The evidence sink of the data plane, the health stage and probes.

Each outcome becomes one event (`LegFailed`, `LegSucceeded`) applied by the fleet's reducer,
which keeps the streaks and applies the spec's failure table; the effects it returns (a
suspect probe) go to the handlers the control plane registered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from narwhal.clock import Clock
from narwhal.engine.failures import EngineFailure, SuccessKind
from narwhal.fleet.events import LegFailed, LegSucceeded, SuspectProbe
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.store import Fleet

log = logging.getLogger("narwhal.evidence")

EffectHandler = Callable[[SuspectProbe], None]


class EvidenceRecorder:
    def __init__(self, fleet: Fleet, clock: Clock, stats: IntervalStats | None = None) -> None:
        self._fleet = fleet
        self._clock = clock
        self._stats = stats
        self._handlers: list[EffectHandler] = []

    def on_effect(self, handler: EffectHandler) -> None:
        self._handlers.append(handler)

    def failure(self, engine_id: str, failure: EngineFailure, leg: str) -> None:
        cls = failure.failure_class
        if self._stats is not None:
            self._stats.failure(engine_id, cls.value)
        log.debug("engine %s %s failure on %s leg (%s)", engine_id, cls.value, leg, failure.detail)
        event = LegFailed(engine_id, cls, failure.detail, leg)
        for effect in self._fleet.apply(event, self._clock.monotonic()):
            for handler in self._handlers:
                handler(effect)

    async def settled(self) -> None:
        """Outcomes are applied as they are reported: nothing to wait for."""

    def success(self, engine_id: str, kind: SuccessKind, leg: str) -> None:
        engine = self._fleet.find(engine_id)
        if engine is None or not engine.evidence:
            return  # the hot path (every successful leg): nothing to clear, no event to send
        self._fleet.apply(LegSucceeded(engine_id, kind, leg), self._clock.monotonic())
