"""The `health` and `liveness` monitor stages.

Health: `GET /health` on every engine not ejected, concurrently, over the control pool with
`engine.health_timeout_s`; outcomes feed the evidence recorder. Liveness keeps its own
per-engine miss counter: a sweep with no response at all is a miss, a sweep in which the engine
answered (any status, so every successful health response) resets it, and
`recovery.liveness_misses` consecutive silent sweeps eject the engine.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from enum import StrEnum

import orjson

from narwhal.config import Config
from narwhal.control.evidence import EvidenceRecorder
from narwhal.control.fleet import EngineState, Fleet
from narwhal.control.holds import HoldName
from narwhal.control.lifecycle import Lifecycle
from narwhal.engine.failures import EngineFailure, SuccessKind, classify_status
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import ControlPoolBusy, EngineClient, control_get
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.health")


class Answer(StrEnum):
    OK = "ok"  # HTTP 200
    ERROR = "error"  # some other HTTP status: alive, not healthy
    SILENT = "silent"  # no response at all (refused, reset, timed out)
    BUSY = "busy"  # no control connection came free: the engine was not asked


@dataclass(frozen=True, slots=True)
class HealthResult:
    """`failure` is the evidence to record (or why a BUSY engine was not asked); an ERROR
    without one is a 4xx other than 408/429, which clears what a client 4xx clears."""

    answer: Answer
    failure: EngineFailure | None = None
    status: int | None = None

    @property
    def detail(self) -> str:
        if self.failure is not None:
            return self.failure.detail
        if self.status is not None:
            return f"health answered HTTP {self.status}"
        return "health 200" if self.answer is Answer.OK else "no answer"


async def check_health(
    client: EngineClient, adapters: Adapters, engine: EngineState, timeout_s: float
) -> HealthResult:
    """One health probe over the control pool, classified (and shown to the adapter)."""
    try:
        reply = await control_get(client, engine.config, "/health", timeout_s)
    except ControlPoolBusy as exc:
        return HealthResult(Answer.BUSY, exc)
    except EngineFailure as exc:
        adapters.observe_health(engine.config, False)
        return HealthResult(Answer.SILENT, exc)
    if reply.status == 200:
        adapters.observe_health(engine.config, True)
        return HealthResult(Answer.OK, status=200)
    cls = classify_status(reply.status)
    if cls is None:  # spec: a 4xx other than 408/429 is not failure evidence, nor "Health 200"
        return HealthResult(Answer.ERROR, status=reply.status)
    return HealthResult(
        Answer.ERROR,
        EngineFailure(cls, f"health answered HTTP {reply.status}", status=reply.status),
        status=reply.status,
    )


class HealthStages:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        client: EngineClient,
        evidence: EvidenceRecorder,
        lifecycle: Lifecycle,
        metrics: Metrics,
        adapters: Adapters,
    ) -> None:
        self._cfg = config
        self._adapters = adapters
        self._fleet = fleet
        self._client = client
        self._evidence = evidence
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._last: dict[str, HealthResult] | None = None

    async def health(self, now: float) -> None:
        """Check every engine concurrently and record the outcomes. Each healthy engine then
        has what is missing about it learned in its own task, cut off at the stage's deadline,
        so the whole stage takes at most about `engine.health_timeout_s` however many engines
        are slow, and one engine's hang never stops the others from learning (a hanging
        `/metrics` or `/v1/models` delays nothing: what was not learned in time is asked
        again next pass)."""
        deadline = asyncio.get_running_loop().time() + self._cfg.engine.health_timeout_s
        self._last = None
        engines = [
            e
            for e in self._fleet
            if e.ejected is None or HoldName.FAILURE_QUARANTINE in e.active_holds_by_name(now)
        ]
        timeout = self._cfg.engine.health_timeout_s
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._check(e, timeout, deadline)) for e in engines]
        except ExceptionGroup as group_error:
            raise group_error.exceptions[0] from None  # the stage's error names the real class
        results = [task.result() for task in tasks]
        self._last = {}
        for engine, result in zip(engines, results, strict=True):
            self._last[engine.id] = result
            self._metrics.health_checks.labels(engine.id, result.answer.value).inc()
            if result.answer is Answer.OK:
                self._evidence.success(engine.id, SuccessKind.HEALTH_OK, "health")
                self._lifecycle.health_ok(engine, now)
            elif result.answer is Answer.BUSY:
                log.warning("engine %s: health check skipped: %s", engine.id, result.failure)
            elif engine.ejected is None:
                if result.failure is None:  # a 4xx other than 408/429: clears, not healthy
                    self._evidence.success(engine.id, SuccessKind.CLIENT_4XX, "health")
                else:
                    self._evidence.failure(engine.id, result.failure, "health")

    async def _check(self, engine: EngineState, timeout_s: float, deadline: float) -> HealthResult:
        result = await check_health(self._client, self._adapters, engine, timeout_s)
        if result.answer is Answer.OK:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._learn(engine)
            except TimeoutError:
                log.debug("engine %s: learning cut off at the health timeout", engine.id)
        return result

    async def _learn(self, engine: EngineState) -> None:
        """What a healthy engine's identity and limits are, read once (the adapter's own
        `learn` is cheap when it knows already)."""
        if engine.max_model_len is None:
            await self._learn_model_limit(engine)
        if engine.generation is None:
            generation, _ = await self._adapters(engine.config).generation(engine.config)
            if generation is not None:
                engine.generation = generation  # so maintenance can compare
        await self._adapters(engine.config).learn(engine.config)

    async def _learn_model_limit(self, engine: EngineState) -> None:
        """Read `max_model_len` from `/v1/models`, for prompt-length checks."""
        try:
            reply = await control_get(
                self._client, engine.config, "/v1/models", self._cfg.engine.health_timeout_s
            )
            data = orjson.loads(reply.body)["data"]
            limit = next(m.get("max_model_len") for m in data if m.get("id") == self._cfg.model)
        except (EngineFailure, orjson.JSONDecodeError, KeyError, TypeError, StopIteration):
            return
        if isinstance(limit, int) and limit > 0:
            engine.max_model_len = limit

    async def liveness(self, now: float) -> None:
        """Count consecutive silent sweeps; any answer (even a 503) ends the run of silence."""
        results = self._last
        if results is None:
            return  # the health stage itself failed: no sweep happened, nothing to count
        limit = self._cfg.recovery.liveness_misses
        for engine_id, result in results.items():
            engine = self._fleet.get(engine_id)
            if engine.ejected is not None:
                continue
            if result.answer is Answer.SILENT:
                engine.liveness_misses += 1
                if engine.liveness_misses >= limit:
                    self._lifecycle.eject(
                        engine, "liveness", f"{engine.liveness_misses} silent health sweeps", now
                    )
            elif result.answer in (Answer.OK, Answer.ERROR):
                engine.liveness_misses = 0  # it answered: the sweep was not silent
            # BUSY: the engine was not asked, so the sweep says nothing either way
            self._metrics.liveness_misses.labels(engine_id).set(engine.liveness_misses)
