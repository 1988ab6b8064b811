"""Inference probes: a tiny real PD round trip over the control pool (for an embed engine,
one embeddings request).

A probed prefill engine runs the prefill leg and a healthy decode peer consumes its
handoff; a probed decode engine consumes a healthy prefill peer's handoff (decode engines
reject bare probes). A leg failed by the probed engine fails the probe; a leg that cannot
conclude (no peer, the peer failed, the control pool timed out) is inconclusive.

The peer is an eligible engine of the other role; when there is none, an engine held only for
inference verification stands in, so two suspects (say the only prefill and the only decode
engine) verify each other instead of waiting forever for an eligible peer. A passing round trip
then clears both; each engine is charged only in its own probe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from narwhal.clock import Clock
from narwhal.config import Config, Role
from narwhal.control.engine_tasks import EngineTasks
from narwhal.control.lifecycle import Lifecycle
from narwhal.dataplane.placement import least_in_flight
from narwhal.dataplane.sse import SseScanner
from narwhal.engine.adapter import FinishedInPrefill, HandoffRefused, SlotsBusy, Unreadable
from narwhal.engine.failures import (
    EngineFailure,
    FailureClass,
    classify_status,
)
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import (
    ControlPoolBusy,
    EngineClient,
    PoolKind,
    classify_exception,
    engine_headers,
)
from narwhal.fleet.events import InferenceVerified
from narwhal.fleet.holds import HoldName
from narwhal.fleet.state import Candidate, EngineState
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.probes")

PROBE_PROMPT = "narwhal inference probe"


class Verdict(StrEnum):
    OK = "ok"
    FAILED = "failed"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    verdict: Verdict
    reason: str
    failure_class: FailureClass | None = None
    peer: str | None = None  # the peer engine whose leg completed the round trip


class Inconclusive(Exception):
    """The probe could not conclude for a reason that is not the engine's (no free slot)."""


PROBE = "inference_probe"


class InferenceProber:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        client: EngineClient,
        lifecycle: Lifecycle,
        metrics: Metrics,
        clock: Clock,
        adapters: Adapters,
    ) -> None:
        self._cfg = config
        self._adapters = adapters
        self._fleet = fleet
        self._client = client
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._clock = clock
        self.last: dict[str, ProbeResult] = {}

    def reconfigure(self, config: Config) -> None:
        """A reloaded config (control/reload.py): read from the next use on."""
        self._cfg = config

    def schedule(self, tasks: EngineTasks) -> None:
        """Start a probe for every held engine that has none running (called each pass)."""
        for engine in self._fleet:
            if (
                HoldName.INFERENCE_VERIFICATION in engine.holds
                and engine.ejected is None
                and not tasks.busy(PROBE, engine.id)
            ):
                tasks.start(PROBE, engine.id, self._probe_and_apply(engine))

    async def _probe_and_apply(self, engine: EngineState) -> None:
        result = await self.probe(engine)
        self.apply(engine, result, self._clock.monotonic())

    def apply(self, engine: EngineState, result: ProbeResult, now: float) -> None:
        engine = self._fleet.get(engine.id)  # as it is now, not as the probe began
        self.last[engine.id] = result
        self._metrics.probes.labels(engine.id, "inference", result.verdict.value).inc()
        if result.verdict is Verdict.OK:
            self._passed(engine, "probe passed", now)
            peer = self._fleet.get(result.peer) if result.peer is not None else None
            if peer is not None and peer.ejected is None and self._verifying(peer, now):
                # A held peer that completed the round trip passed it too.
                self._passed(peer, f"ran the passing probe of {engine.id}", now)
        elif result.verdict is Verdict.FAILED:
            cause = (result.failure_class or FailureClass.INFERENCE_STATUS).value
            self._lifecycle.eject(engine, cause, f"inference probe failed: {result.reason}", now)
        else:
            log.info("engine %s inference probe inconclusive: %s", engine.id, result.reason)

    def _passed(self, engine: EngineState, reason: str, now: float) -> None:
        """A successful inference check: clears the inference evidence and both holds."""
        self._fleet.apply(InferenceVerified(engine.id, reason), now)

    @staticmethod
    def _verifying(engine: EngineState, now: float) -> bool:
        return HoldName.INFERENCE_VERIFICATION in engine.active_holds_by_name(now)

    def peer(self, role: Role, probed: EngineState) -> EngineState | None:
        """The least busy eligible engine of `role` other than `probed`; failing that, one
        that is only held for inference verification (see the module docstring)."""
        now = self._clock.monotonic()
        model = probed.model  # a peer serves the same model (its KV must fit)
        candidates = [c for c in self._fleet.candidates(role, now, model) if c.id != probed.id]
        if not candidates:
            candidates = [
                Candidate(e.id, self._fleet.in_flight.of(e.id))
                for e in self._fleet.verification_peers(role, now, model)
                if e.id != probed.id
            ]
        peer_id = least_in_flight(candidates, 0)
        return None if peer_id is None else self._fleet.get(peer_id)

    async def probe(self, engine: EngineState) -> ProbeResult:
        """One probe; never raises for engine trouble."""
        try:
            if engine.role is Role.EMBED:
                await self.embed(engine)
                return ProbeResult(Verdict.OK, "answered an embeddings request")
            if engine.role is Role.BOTH:
                await self.decode_leg(engine, self.unified_body(engine))
                return ProbeResult(Verdict.OK, "unified leg completed")
            if engine.role is Role.PREFILL:
                return await self._probe_prefill(engine)
            return await self._probe_decode(engine)
        except ControlPoolBusy as exc:
            return ProbeResult(Verdict.INCONCLUSIVE, str(exc))
        except EngineFailure as exc:
            return ProbeResult(Verdict.FAILED, str(exc), exc.failure_class)
        except HandoffRefused as exc:
            return ProbeResult(Verdict.FAILED, str(exc), FailureClass.KV_HANDOFF)
        except Inconclusive as exc:
            return ProbeResult(Verdict.INCONCLUSIVE, str(exc))

    async def _probe_prefill(self, engine: EngineState) -> ProbeResult:
        handoff = await self.prefill_leg(engine)
        try:
            peer = self.peer(Role.DECODE, engine)
            if peer is None:
                return ProbeResult(Verdict.INCONCLUSIVE, "no healthy decode peer")
            try:
                await self.decode_with(peer, handoff)
            except EngineFailure as exc:
                return ProbeResult(Verdict.INCONCLUSIVE, f"decode peer {peer.id}: {exc}")
            return ProbeResult(Verdict.OK, f"prefill leg ok, consumed by {peer.id}", peer=peer.id)
        finally:
            await self.discard(engine, handoff)

    async def _probe_decode(self, engine: EngineState) -> ProbeResult:
        peer = self.peer(Role.PREFILL, engine)
        if peer is None:
            return ProbeResult(Verdict.INCONCLUSIVE, "no healthy prefill peer")
        try:
            handoff = await self.prefill_leg(peer)
        except (EngineFailure, Inconclusive) as exc:
            return ProbeResult(Verdict.INCONCLUSIVE, f"prefill peer {peer.id}: {exc}")
        try:
            await self.decode_with(engine, handoff)
        except HandoffRefused as exc:  # the producer's fault (DESIGN §1), not the probed one's
            return ProbeResult(Verdict.INCONCLUSIVE, f"handoff from {peer.id} refused: {exc}")
        finally:
            await self.discard(peer, handoff)
        return ProbeResult(Verdict.OK, f"decode leg ok on a handoff from {peer.id}", peer=peer.id)

    def _probe_body(self, engine: EngineState) -> dict[str, Any]:
        model = engine.model or self._cfg.model
        return {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 2, "stream": True}

    def unified_body(self, engine: EngineState) -> dict[str, Any]:
        return self._adapters(engine.config).unified_body(self._probe_body(engine))

    def _headers(self, engine: EngineState) -> dict[str, Any]:
        return engine_headers(engine.config.resolved_api_key(), f"narwhal-probe-{engine.id}")

    async def prefill_leg(self, engine: EngineState) -> object:
        """A prefill on `engine` that must yield a readable handoff (discard it after use)."""
        try:
            reply = await self._adapters(engine.config).prefill(
                PoolKind.CONTROL,
                engine.config,
                "completions",
                {"model": engine.model or self._cfg.model, "prompt": PROBE_PROMPT},
                self._headers(engine),
                self._cfg.engine.probe_timeout_s,
            )
        except SlotsBusy as exc:
            raise Inconclusive(str(exc)) from None
        if reply.status != 200:
            cls = classify_status(reply.status) or FailureClass.INFERENCE_STATUS
            raise EngineFailure(
                cls, f"prefill leg answered HTTP {reply.status}", status=reply.status
            )
        if isinstance(reply.result, Unreadable | FinishedInPrefill) or reply.result is None:
            reason = reply.result.reason if isinstance(reply.result, Unreadable) else "no handoff"
            raise EngineFailure(FailureClass.KV_HANDOFF, f"prefill leg: {reason}")
        return reply.result

    async def decode_with(self, engine: EngineState, handoff: object) -> None:
        """Consume `handoff` on `engine`: HandoffRefused when it cannot be used (refused on
        restore, or evidently recomputed), EngineFailure when the engine fails the leg."""
        adapter = self._adapters(engine.config)
        try:
            async with adapter.decode(
                PoolKind.CONTROL,
                engine.config,
                self._probe_body(engine),
                handoff,
                self._headers(engine),
                self._cfg.engine.probe_timeout_s,
            ) as body:
                last = await self.decode_leg(engine, body)
        except SlotsBusy as exc:
            raise Inconclusive(str(exc)) from None
        reason = adapter.recomputed(last)
        if reason is not None:
            raise HandoffRefused(reason)

    async def embed(self, engine: EngineState) -> None:
        """An embed engine's inference check: one embeddings request must come back with a
        vector (an embed engine has no PD round trip to run)."""
        body = {"model": engine.model or self._cfg.model, "input": PROBE_PROMPT}
        reply = await self._client.post(
            PoolKind.CONTROL,
            engine.config.url + "/v1/embeddings",
            orjson.dumps(body),
            self._headers(engine),
            self._cfg.engine.probe_timeout_s,
        )
        if reply.status != 200:
            cls = classify_status(reply.status) or FailureClass.INFERENCE_STATUS
            raise EngineFailure(
                cls, f"embeddings answered HTTP {reply.status}", status=reply.status
            )
        try:
            vector = orjson.loads(reply.body)["data"][0]["embedding"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise EngineFailure(
                FailureClass.INFERENCE_STATUS, f"embeddings answer unreadable: {exc!r}"
            ) from None
        if not vector:
            raise EngineFailure(FailureClass.INFERENCE_STATUS, "embeddings answer has no vector")

    async def discard(self, producer: EngineState, handoff: object) -> None:
        await self._adapters(producer.config).discard(producer.config, handoff)

    async def decode_leg(self, engine: EngineState, body: dict[str, Any]) -> bytes | None:
        """Run a streamed leg to its terminal marker within the probe timeout; returns the
        last data event."""
        headers = self._headers(engine)
        scanner = SseScanner()
        timeout_s = self._cfg.engine.probe_timeout_s
        url = engine.config.url + "/v1/completions"
        try:
            async with self._client.deadline(PoolKind.CONTROL, timeout_s):
                resp = await self._client.stream(
                    url, orjson.dumps(body), headers, pool=PoolKind.CONTROL
                )
                try:
                    if resp.status != 200:
                        cls = classify_status(resp.status) or FailureClass.INFERENCE_STATUS
                        raise EngineFailure(
                            cls, f"decode leg answered HTTP {resp.status}", status=resp.status
                        )
                    while chunk := await resp.readany():
                        scanner.feed(chunk)
                        if scanner.done:
                            break  # the answer is complete, whether or not the engine hangs up
                    else:
                        scanner.end()  # a final `data: [DONE]` line without its blank line
                finally:
                    resp.release()  # kept for reuse if read to its end, else closed
        except (TimeoutError, OSError) as exc:
            raise classify_exception(exc, FailureClass.STREAM) from None
        if scanner.malformed or not scanner.done:
            raise EngineFailure(FailureClass.STREAM, "decode leg ended without [DONE]")
        if scanner.error is not None:  # as the data plane: an error status reported in band
            raise EngineFailure(FailureClass.INFERENCE_STATUS, "decode leg sent an error event")
        return scanner.last
