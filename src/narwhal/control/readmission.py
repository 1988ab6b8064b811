"""Readmission: ejected engines come back only after verification, retried with backoff.

Steps run in order over the control pool and stop at the first failure, which is reported
with its step name and reason: health, attestation, model identity, generation identity,
role-permitted KV transfer (declared and functional), final health.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from narwhal.clock import Clock
from narwhal.config import KV_ROLE_PERMITS, Config, Role
from narwhal.control.attestation import Outcome, attest
from narwhal.control.engine_tasks import EngineTasks
from narwhal.control.health import Answer, check_health
from narwhal.control.lifecycle import Lifecycle
from narwhal.control.probes import Inconclusive, InferenceProber
from narwhal.engine.adapter import HandoffRefused
from narwhal.engine.failures import EngineFailure
from narwhal.engine.registry import Adapters
from narwhal.engine.resumptions import restarted_since
from narwhal.engine.transport import EngineClient, control_get
from narwhal.fleet.events import GenerationSeen
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.readmission")

ATTEMPT = "readmission"


@dataclass(frozen=True, slots=True)
class StepResult:
    step: str
    ok: bool
    reason: str
    status: str = ""  # passed | failed | not_configured | unknown

    def to_json(self) -> dict[str, Any]:
        status = self.status or ("passed" if self.ok else "failed")
        return {"step": self.step, "ok": self.ok, "status": status, "reason": self.reason}


STEPS = (
    "health",
    "attestation",
    "model_identity",
    "generation_identity",
    "kv_transfer",
    "final_health",
)


GENERATION_UNKNOWN = "generation unknown (engine exports no process_start_time_seconds)"


def _status(step: str, reason: str) -> str:
    """A step that passed without verifying says so: `not_configured` or `unknown`."""
    if step == "attestation" and reason == "attestation not configured":
        return "not_configured"
    if step == "generation_identity" and reason.startswith(GENERATION_UNKNOWN):
        return "unknown"
    return ""


MAX_DOUBLINGS = 60
"""Past this many doublings any sane base is beyond any cap; a larger exponent would overflow a
float (an engine that keeps failing counts attempts for as long as it stays out)."""


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Exponential backoff with a cap and jitter in [delay/2, delay]."""
    delay = min(cap_s, base_s * 2.0 ** min(max(0, attempt - 1), MAX_DOUBLINGS))
    return delay / 2 + rng.random() * delay / 2


def attempt_due(engine: EngineState, now: float, next_try: float | None, running: bool) -> bool:
    """Whether the readmission stage starts an attempt for `engine` now.

    Ejected engines and engines under planned maintenance are retried once their backoff
    passed, one attempt per engine at a time; an unexpired failure quarantine waits for its
    deadline (or a successful health check). An engine that is only drained is never retried.
    """
    if engine.ejected is None and HoldName.PLANNED_MAINTENANCE not in engine.holds:
        return False
    if running or now < (next_try or 0.0):
        return False
    quarantine = engine.holds.get(HoldName.FAILURE_QUARANTINE)
    return quarantine is None or quarantine.expired(now)


class Readmission:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        client: EngineClient,
        lifecycle: Lifecycle,
        metrics: Metrics,
        rng: random.Random,
        prober: InferenceProber,
        adapters: Adapters,
        clock: Clock,
    ) -> None:
        self._cfg = config
        self._adapters = adapters
        self._fleet = fleet
        self._client = client
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._rng = rng
        self._prober = prober
        self._clock = clock
        self._next_try: dict[str, float] = {}
        self._attempts: dict[str, int] = {}
        self.last_results: dict[str, list[StepResult]] = {}

    async def current_generation(self, engine: EngineState, requested_at_wall: float) -> float:
        """The generation running now, read from the engine (planned maintenance's baseline).

        The recorded generation may be stale (an in-place restart is not noticed by the health
        stage), so it is read again. If it cannot be read, the request time is the baseline:
        any process running now started before it.
        """
        generation, why = await self._adapters(engine.config).generation(engine.config)
        if generation is None:
            log.info(
                "engine %s: generation unreadable (%s): maintenance baseline is the request time",
                engine.id,
                why,
            )
            return requested_at_wall
        self._fleet.apply(GenerationSeen(engine.id, generation), self._clock.monotonic())
        return generation

    def reconfigure(self, config: Config) -> None:
        """A reloaded config (control/reload.py): read from the next use on."""
        self._cfg = config

    def schedule(self, now: float, tasks: EngineTasks) -> None:
        """The `readmission` stage: start due attempts in the background, never wait for one.

        A slow engine must not delay the monitor pass; each attempt's result is applied by
        `apply` when it ends.
        """
        for engine in self._fleet:
            if engine.ejected is None and HoldName.PLANNED_MAINTENANCE not in engine.holds:
                self._next_try.pop(engine.id, None)
                self._attempts.pop(engine.id, None)
                continue
            running = tasks.busy(ATTEMPT, engine.id)
            if attempt_due(engine, now, self._next_try.get(engine.id), running):
                # The maintenance hold as it is now: the attempt checks against its baseline.
                maintenance = engine.holds.get(HoldName.PLANNED_MAINTENANCE)
                tasks.start(ATTEMPT, engine.id, self._attempt(engine, maintenance))

    async def _attempt(self, engine: EngineState, maintenance: Hold | None) -> None:
        try:
            results = await self.verify(engine)
        except Exception:  # a crash is a failed attempt: it backs off like one
            log.exception("engine %s: readmission attempt crashed", engine.id)
            results = [StepResult("health", False, "readmission attempt crashed")]
        self.apply(engine, results, maintenance, self._clock.monotonic())

    def apply(
        self,
        engine: EngineState,
        results: list[StepResult],
        maintenance_at_start: Hold | None,
        now: float,
    ) -> None:
        """Readmit after a passed attempt, else back off; discard a result overtaken by events.

        Maintenance requested while the attempt ran (its baseline was not checked), or an
        engine already back in placement, makes the result stale: the next pass decides.
        """
        engine = self._fleet.get(engine.id)  # as it is now, not as the attempt began
        stale = engine.holds.get(HoldName.PLANNED_MAINTENANCE) is not maintenance_at_start
        waiting = engine.ejected is not None or HoldName.PLANNED_MAINTENANCE in engine.holds
        if stale or not waiting:
            log.info("engine %s: readmission result discarded: state changed meanwhile", engine.id)
            return
        if all(r.ok for r in results):
            self._lifecycle.readmit(engine, "verified", now)
            self._next_try.pop(engine.id, None)  # a later ejection starts a fresh backoff
            self._attempts.pop(engine.id, None)
            return
        n = self._attempts.get(engine.id, 0) + 1
        self._attempts[engine.id] = n
        interval = self._cfg.controller.monitor_interval_s
        self._next_try[engine.id] = now + backoff_s(n, interval, 30 * interval, self._rng)

    async def verify(
        self, engine: EngineState, on_step: Callable[[StepResult], None] | None = None
    ) -> list[StepResult]:
        """Run the steps in order, up to the first that fails; `on_step` hears each result
        as it comes (an operator following `narwhal readmit`)."""
        results: list[StepResult] = []
        checks = (
            self._health,
            self._attestation,
            self._model,
            self._generation,
            self._kv_transfer,
            self._health,
        )
        for name, step in zip(STEPS, checks, strict=True):
            ok, reason = await step(engine)
            results.append(StepResult(name, ok, reason, _status(name, reason)))
            if on_step is not None:
                on_step(results[-1])
            result = "ok" if ok else "failed"
            self._metrics.probes.labels(engine.id, f"readmission:{name}", result).inc()
            if not ok:
                log.info("engine %s readmission failed at %s: %s", engine.id, name, reason)
                break
        self.last_results[engine.id] = results
        failed = next((r for r in results if not r.ok), None)
        self._metrics.readmissions.labels(
            engine.id, "failed" if failed else "passed", failed.step if failed else ""
        ).inc()
        return results

    async def _health(self, engine: EngineState) -> tuple[bool, str]:
        result = await check_health(
            self._client, self._adapters, engine, self._cfg.engine.health_timeout_s
        )
        if result.answer is Answer.OK:
            return True, "health 200"
        return False, result.detail

    async def _attestation(self, engine: EngineState) -> tuple[bool, str]:
        result = await attest(self._cfg.attestation, engine.config, self._client)
        return result.outcome is not Outcome.FAILED, result.reason

    async def _kv_transfer(self, engine: EngineState) -> tuple[bool, str]:
        return await self.verify_kv_role(engine, engine.role)

    async def verify_kv_role(self, engine: EngineState, role: Role) -> tuple[bool, str]:
        """The declared KV role permits `role`, and the engine does it functionally."""
        kv_role = engine.config.effective_kv_role
        if role not in KV_ROLE_PERMITS[kv_role]:
            return False, f"kv_role {kv_role.value} does not permit role {role.value}"
        prober = self._prober
        try:
            if role is Role.EMBED:
                await prober.embed(engine)
                return True, "transfers no KV (embed engine); answered an embeddings request"
            if role is Role.PREFILL:
                await prober.discard(engine, await prober.prefill_leg(engine))
                return True, "produced a readable handoff"
            if role is Role.DECODE:
                peer = prober.peer(Role.PREFILL, engine)
                if peer is None:
                    return False, "no healthy prefill peer to produce a handoff to consume"
                try:
                    handoff = await prober.prefill_leg(peer)
                except (EngineFailure, Inconclusive) as exc:
                    return False, f"prefill peer {peer.id} could not produce a handoff: {exc}"
                try:
                    await prober.decode_with(engine, handoff)
                finally:
                    await prober.discard(peer, handoff)
                return True, f"consumed a handoff from {peer.id}"
            await prober.decode_leg(engine, prober.unified_body(engine))
            return True, "served a unified request"
        except (EngineFailure, HandoffRefused, Inconclusive) as exc:
            return False, str(exc)

    async def _model(self, engine: EngineState) -> tuple[bool, str]:
        try:
            reply = await control_get(
                self._client, engine.config, "/v1/models", self._cfg.engine.probe_timeout_s
            )
            models = [m.get("id") for m in orjson.loads(reply.body)["data"]]
        except (EngineFailure, orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            return False, f"cannot read /v1/models: {exc}"
        model = engine.model or self._cfg.model
        if model not in models:
            return False, f"serves {models}, not {model!r}"
        return True, f"serves {model!r}"

    async def _generation(self, engine: EngineState) -> tuple[bool, str]:
        generation, why = await self._adapters(engine.config).generation(engine.config)
        engine = self._fleet.get(engine.id)  # as it is now
        if generation is None:
            return self._unknown_generation(engine, why)
        if engine.generation is not None and generation < engine.generation:
            return False, f"generation {generation} is older than last seen {engine.generation}"
        maintenance = engine.holds.get(HoldName.PLANNED_MAINTENANCE)
        if maintenance is not None:
            before = maintenance.newer_than
            if before is None:  # a hold restored from an older handoff: the last seen one
                before = engine.generation
            if before is not None and generation <= before:
                return False, f"planned maintenance needs a process newer than {before}"
        self._fleet.apply(GenerationSeen(engine.id, generation), self._clock.monotonic())
        return True, f"generation {generation}"

    def _unknown_generation(self, engine: EngineState, why: str) -> tuple[bool, str]:
        """An engine that never exported a generation passes unverified (status `unknown`);
        one that did and no longer does fails (something changed). Planned maintenance on it
        ends once the engine went silent on `/health` after the request and answered again."""
        if engine.generation is not None:
            return False, f"{why} (generation {engine.generation} was seen before)"
        maintenance = engine.holds.get(HoldName.PLANNED_MAINTENANCE)
        if maintenance is None:
            return True, GENERATION_UNKNOWN
        resumption = self._adapters.resumptions.last(engine.id)
        if not restarted_since(resumption, maintenance.since_wall):
            return False, (
                "planned maintenance needs a restart: generation unknown, and the engine has "
                "not gone silent on /health and answered again since the request"
            )
        assert resumption is not None
        return True, (
            f"{GENERATION_UNKNOWN}; restarted: silent on /health from {resumption.silent_wall:.3f},"
            f" answering again at {resumption.answered_wall:.3f}"
        )
