"""Suspect probes: a timeout or overload streak asks for one health probe (the reducer's
`SuspectProbe` effect), which confirms the streak (ejection) or clears it (health 200).

One probe per engine at a time, started in the leadership scope like every engine task.
"""

from __future__ import annotations

import logging

from narwhal.clock import Clock
from narwhal.config import Config
from narwhal.control.engine_tasks import EngineTasks
from narwhal.control.health import Answer, check_health
from narwhal.control.lifecycle import Lifecycle
from narwhal.engine.failures import FailureClass
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient
from narwhal.fleet.events import SuspectProbe
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.suspects")

KIND = "suspect_probe"


class SuspectProbes:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        client: EngineClient,
        adapters: Adapters,
        lifecycle: Lifecycle,
        metrics: Metrics,
        clock: Clock,
        tasks: EngineTasks,
    ) -> None:
        self._cfg = config
        self._fleet = fleet
        self._client = client
        self._adapters = adapters
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._clock = clock
        self._tasks = tasks

    def reconfigure(self, config: Config) -> None:
        """A reloaded config (control/reload.py): read from the next use on."""
        self._cfg = config

    def on_effect(self, effect: SuspectProbe) -> None:
        if not self._tasks.busy(KIND, effect.engine_id):
            work = self.probe(effect.engine_id, effect.failure_class)
            self._tasks.start(KIND, effect.engine_id, work)

    async def probe(self, engine_id: str, cls: FailureClass) -> None:
        """One suspect health probe, and what its answer means for the engine."""
        engine = self._fleet.get(engine_id)
        if engine.ejected is not None:
            return
        result = await check_health(
            self._client, self._adapters, engine, self._cfg.engine.health_timeout_s
        )
        now = self._clock.monotonic()
        self._metrics.probes.labels(engine_id, "suspect_health", result.answer.value).inc()
        if result.answer is Answer.OK:
            self._lifecycle.health_ok(engine, now)
        elif result.answer is Answer.BUSY:  # never asked: the streak stands, nothing confirmed
            log.warning("engine %s: suspect probe not run: %s", engine_id, result.failure)
        else:
            self._lifecycle.eject(engine, cls.value, f"suspect probe failed: {result.detail}", now)
