"""The `health` and `liveness` monitor stages.

Health: `GET /health` on every engine not ejected, concurrently, over the control pool with
`engine.health_timeout_s`; outcomes feed the evidence recorder. Liveness keeps its own
per-engine miss counter: a sweep with no response at all is a miss, a sweep in which the engine
answered (any status, so every successful health response) resets it, and
`recovery.liveness_misses` consecutive silent sweeps eject the engine.

Verification (DESIGN §10): an unverified engine becomes eligible at its first health 200
whose `/v1/models` names the configured model. Until then it is checked like any other engine
(its failures are evidence, its silence counts), so an engine dead at start is ejected and
comes back through readmission, whose pipeline verifies it. `startup_sweep` runs once at start,
so a healthy fleet is ready within one health timeout, not one monitor interval.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple

import orjson

from narwhal.config import Config
from narwhal.control.evidence import EvidenceRecorder
from narwhal.control.lifecycle import Lifecycle
from narwhal.engine.failures import EngineFailure, SuccessKind, classify_status
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import ControlPoolBusy, EngineClient, control_get
from narwhal.fleet.events import GenerationSeen, LivenessSwept, ModelLimitLearned
from narwhal.fleet.holds import HoldName
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.health")


class Answer(StrEnum):
    OK = "ok"  # HTTP 200
    ERROR = "error"  # some other HTTP status: alive, not healthy
    SILENT = "silent"  # no response at all (refused, reset, timed out)
    BUSY = "busy"  # no control connection came free: the engine was not asked


class Served(NamedTuple):
    """What `/v1/models` lists: every model id, and which of them are LoRA adapters."""

    models: tuple[str, ...]
    adapters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HealthResult:
    """`failure` is the evidence to record (or why a BUSY engine was not asked); an ERROR
    without one is a 4xx other than 408/429, which clears what a client 4xx clears."""

    answer: Answer
    failure: EngineFailure | None = None
    status: int | None = None
    models: tuple[str, ...] | None = None  # served models, when `/v1/models` was read
    adapters: tuple[str, ...] = ()  # those of them that are LoRA adapters (a `parent`)
    models_problem: str | None = None  # why `/v1/models` was not read, when it was tried

    @property
    def detail(self) -> str:
        if self.failure is not None:
            return self.failure.detail
        if self.status is not None:
            return f"health answered HTTP {self.status}"
        return "health 200" if self.answer is Answer.OK else "no answer"


def verification(result: HealthResult, model: str) -> tuple[bool, str]:
    """Whether one health answer verifies an engine for `model`, and why (not): a 200 and a
    `/v1/models` that lists `model` (what vLLM, llama-server's `--alias` and narwhal-sim
    report). Pure, over the answer."""
    if result.answer is not Answer.OK:
        return False, f"waiting for a healthy answer: {result.detail}"
    if result.models is None:
        problem = result.models_problem or "not read in time"
        return False, f"health 200, served model unknown: /v1/models {problem}"
    if model not in result.models:
        return False, f"serves {list(result.models)}, not {model!r}"
    return True, f"health 200, serves {model!r}"


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
                tasks = [group.create_task(self._check(e, timeout, deadline, now)) for e in engines]
        except ExceptionGroup as group_error:
            raise group_error.exceptions[0] from None  # the stage's error names the real class
        results = [task.result() for task in tasks]
        self._last = {}
        for checked, result in zip(engines, results, strict=True):
            engine = self._fleet.get(checked.id)  # as it is now, after the checks
            self._last[engine.id] = result
            self._metrics.health_checks.labels(engine.id, result.answer.value).inc()
            if result.answer is Answer.OK:
                self._lifecycle.health_ok(engine, now)
            elif result.answer is Answer.BUSY:
                log.warning("engine %s: health check skipped: %s", engine.id, result.failure)
            elif engine.ejected is None:
                if result.failure is None:  # a 4xx other than 408/429: clears, not healthy
                    self._evidence.success(engine.id, SuccessKind.CLIENT_4XX, "health")
                else:
                    self._evidence.failure(engine.id, result.failure, "health")
            if result.answer is not Answer.BUSY:  # BUSY: not asked, says nothing
                self._verify(engine.id, result, now)

    def reconfigure(self, config: Config) -> None:
        """A reloaded config (control/reload.py): read from the next use on."""
        self._cfg = config

    def _verify(self, engine_id: str, result: HealthResult, now: float) -> None:
        """Apply one answer to an unverified engine (a wrong model is also a warning); of a
        verified one, only the models it lists, when they were read."""
        engine = self._fleet.get(engine_id)
        if engine.verified:
            # Read again while not known (restored from a handoff, or followed as a standby:
            # verified with no list): requests for its LoRA adapters are placed by it.
            if result.models is not None:
                adapters = result.adapters
                self._lifecycle.verify(engine, True, "restored", now, result.models, adapters)
            return
        ok, reason = verification(result, engine.model or self._cfg.model)
        if not ok and result.models is not None and reason != engine.unverified_reason:
            log.warning("engine %s stays unverified: %s", engine.id, reason)
        self._lifecycle.verify(engine, ok, reason, now, result.models or (), result.adapters)

    async def startup_sweep(self, now: float) -> None:
        """At start, before the first pass: check every unverified engine once, concurrently,
        and verify those that answer healthy with the right model, all within
        `engine.health_timeout_s` (what has not answered by then waits for the monitor's
        first pass, which starts right after). It only verifies: failures are recorded by
        the regular passes, so the start adds no extra evidence or liveness miss."""
        timeout = self._cfg.engine.health_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        engines = [e for e in self._fleet if not e.verified and e.ejected is None]

        async def one(engine: EngineState) -> None:
            result = await self._check(engine, timeout, deadline, now)
            if result.answer is not Answer.BUSY:
                self._verify(engine.id, result, now)

        if not engines:
            return
        try:
            async with asyncio.timeout_at(deadline), asyncio.TaskGroup() as group:
                for engine in engines:
                    group.create_task(one(engine))
        except TimeoutError:
            log.info("start-up health sweep cut off at engine.health_timeout_s")
        except Exception as exc:  # never fatal: the monitor's first pass follows at once
            log.warning("start-up health sweep failed: %s: %s", type(exc).__name__, exc)
        unverified = sorted(e.id for e in self._fleet if not e.verified)
        log.info(
            "start-up health sweep: %d of %d engines verified%s",
            len(self._fleet) - len(unverified),
            len(self._fleet),
            f"; unverified: {unverified}" if unverified else "",
        )

    async def _check(
        self, engine: EngineState, timeout_s: float, deadline: float, now: float
    ) -> HealthResult:
        result = await check_health(self._client, self._adapters, engine, timeout_s)
        if result.answer is Answer.OK:
            served: Served | None = None
            problem: str | None = None
            try:
                async with asyncio.timeout_at(deadline):
                    served, problem = await self._learn(engine, now)
            except TimeoutError:
                log.debug("engine %s: learning cut off at the health timeout", engine.id)
            if served is not None:
                result = replace(result, models=served.models, adapters=served.adapters)
            elif problem is not None:
                result = replace(result, models_problem=problem)
        return result

    async def _learn(self, engine: EngineState, now: float) -> tuple[Served | None, str | None]:
        """What a healthy engine's identity and limits are, read once (the adapter's own
        `learn` is cheap when it knows already); `/v1/models` is read on every answer until
        the engine is verified and its list known. Returns the served models read (or why
        they were not)."""
        models: Served | None = None
        problem: str | None = None
        # A verified engine with no list was restored from a document that had none.
        if engine.max_model_len is None or not engine.verified or not engine.served:
            models, problem = await self._read_models(engine, now)
        if engine.generation is None:
            generation, _ = await self._adapters(engine.config).generation(engine.config)
            if generation is not None:  # so maintenance can compare
                self._fleet.apply(GenerationSeen(engine.id, generation), now)
        await self._adapters(engine.config).learn(engine.config)
        return models, problem

    async def _read_models(
        self, engine: EngineState, now: float
    ) -> tuple[Served | None, str | None]:
        """The served model ids from `/v1/models` (or why they could not be read), learning
        `max_model_len` for prompt-length checks on the way. vLLM lists a LoRA adapter
        under its own name with its base model as `parent` (its KV blocks are keyed by the
        adapter's name: placement needs to know)."""
        try:
            reply = await control_get(
                self._client, engine.config, "/v1/models", self._cfg.engine.health_timeout_s
            )
        except EngineFailure as exc:
            return None, f"failed: {exc.detail}"
        if reply.status != 200:
            return None, f"answered HTTP {reply.status}"
        try:
            data = orjson.loads(reply.body)["data"]
            cards = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None, "is not an OpenAI model list"
        model = engine.model or self._cfg.model
        limit = next((m.get("max_model_len") for m in cards if m["id"] == model), None)
        if engine.max_model_len is None and isinstance(limit, int) and limit > 0:
            self._fleet.apply(ModelLimitLearned(engine.id, limit), now)
        adapters = tuple(m["id"] for m in cards if isinstance(m.get("parent"), str))
        return Served(tuple(m["id"] for m in cards), adapters), None

    async def liveness(self, now: float) -> None:
        """Count consecutive silent sweeps; any answer (even a 503) ends the run of silence."""
        results = self._last
        if results is None:
            return  # the health stage itself failed: no sweep happened, nothing to count
        for engine_id, result in results.items():
            # BUSY: the engine was not asked, so the sweep says nothing either way; any
            # answer (OK or ERROR) ends a run of silence.
            if result.answer is not Answer.BUSY:
                silent = result.answer is Answer.SILENT
                self._fleet.apply(LivenessSwept(engine_id, silent), now)
