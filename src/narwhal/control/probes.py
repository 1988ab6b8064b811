"""Inference probes: a tiny real PD round trip over the control pool.

A probed prefill engine runs the prefill leg and a healthy decode peer consumes its
handoff; a probed decode engine consumes a healthy prefill peer's handoff (decode engines
reject bare probes). A leg failed by the probed engine fails the probe; a leg that cannot
conclude (no peer, the peer failed, the control pool timed out) is inconclusive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp
import orjson

from narwhal.clock import Clock
from narwhal.config import Config, Role
from narwhal.control.evidence import EvidenceRecorder
from narwhal.control.fleet import EngineState, Fleet
from narwhal.control.holds import HoldName
from narwhal.control.lifecycle import Lifecycle
from narwhal.dataplane.placement import least_in_flight
from narwhal.dataplane.sse import SseScanner
from narwhal.engine import vllm
from narwhal.engine.failures import (
    INFERENCE_CLASSES,
    EngineFailure,
    FailureClass,
    classify_status,
)
from narwhal.engine.transport import EngineClient, PoolKind, classify_exception, engine_headers
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


class _PeerTrouble(Exception):
    """The peer's leg could not conclude: the probe is inconclusive."""


Spawn = Callable[[Coroutine[Any, Any, None]], object]


class InferenceProber:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        client: EngineClient,
        evidence: EvidenceRecorder,
        lifecycle: Lifecycle,
        metrics: Metrics,
        clock: Clock,
    ) -> None:
        self._cfg = config
        self._fleet = fleet
        self._client = client
        self._evidence = evidence
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._clock = clock
        self._running: set[str] = set()
        self.last: dict[str, ProbeResult] = {}

    def schedule(self, spawn: Spawn) -> None:
        """Start a probe for every held engine that has none running (called each pass)."""
        for engine in self._fleet:
            if (
                HoldName.INFERENCE_VERIFICATION in engine.holds
                and engine.ejected is None
                and engine.id not in self._running
            ):
                self._running.add(engine.id)
                spawn(self._probe_and_apply(engine))

    async def _probe_and_apply(self, engine: EngineState) -> None:
        try:
            result = await self.probe(engine)
        finally:
            self._running.discard(engine.id)
        self.apply(engine, result, self._clock.monotonic())

    def apply(self, engine: EngineState, result: ProbeResult, now: float) -> None:
        self.last[engine.id] = result
        self._metrics.probes.labels(engine.id, "inference", result.verdict.value).inc()
        if result.verdict is Verdict.OK:
            self._evidence.clear(engine.id, INFERENCE_CLASSES)
            self._lifecycle.release(engine, HoldName.INFERENCE_VERIFICATION, "probe passed", now)
            self._lifecycle.release(engine, HoldName.FAILURE_QUARANTINE, "probe passed", now)
        elif result.verdict is Verdict.FAILED:
            cause = (result.failure_class or FailureClass.INFERENCE_STATUS).value
            self._lifecycle.eject(engine, cause, f"inference probe failed: {result.reason}", now)
        else:
            log.info("engine %s inference probe inconclusive: %s", engine.id, result.reason)

    def peer(self, role: Role, probed: EngineState) -> EngineState | None:
        now = self._clock.monotonic()
        candidates = [c for c in self._fleet.candidates(role, now) if c.id != probed.id]
        peer_id = least_in_flight(candidates, 0)
        return None if peer_id is None else self._fleet.get(peer_id)

    async def probe(self, engine: EngineState) -> ProbeResult:
        """One probe; never raises for engine trouble."""
        try:
            if engine.role is Role.BOTH:
                await self.decode_leg(
                    engine,
                    {
                        "model": self._cfg.model,
                        "prompt": PROBE_PROMPT,
                        "max_tokens": 2,
                        "stream": True,
                    },
                )
                return ProbeResult(Verdict.OK, "unified leg completed")
            if engine.role is Role.PREFILL:
                handoff = await self.prefill_leg(engine)
                peer = self.peer(Role.DECODE, engine)
                if peer is None:
                    return ProbeResult(Verdict.INCONCLUSIVE, "no healthy decode peer")
                try:
                    await self.decode_leg(peer, self.decode_body(handoff))
                except EngineFailure as exc:
                    return ProbeResult(Verdict.INCONCLUSIVE, f"decode peer {peer.id}: {exc}")
                return ProbeResult(Verdict.OK, f"prefill leg ok, consumed by {peer.id}")
            peer = self.peer(Role.PREFILL, engine)
            if peer is None:
                return ProbeResult(Verdict.INCONCLUSIVE, "no healthy prefill peer")
            try:
                handoff = await self.prefill_leg(peer)
            except EngineFailure as exc:
                return ProbeResult(Verdict.INCONCLUSIVE, f"prefill peer {peer.id}: {exc}")
            await self.decode_leg(engine, self.decode_body(handoff))
            return ProbeResult(Verdict.OK, f"decode leg ok on a handoff from {peer.id}")
        except EngineFailure as exc:
            return ProbeResult(Verdict.FAILED, str(exc), exc.failure_class)

    def decode_body(self, handoff: vllm.Handoff) -> dict[str, Any]:
        body = {"model": self._cfg.model, "prompt": PROBE_PROMPT, "max_tokens": 2, "stream": True}
        return vllm.decode_body(body, handoff)

    async def prefill_leg(self, engine: EngineState) -> vllm.Handoff:
        body = vllm.prefill_body({"model": self._cfg.model, "prompt": PROBE_PROMPT})
        reply = await self._client.post(
            PoolKind.CONTROL,
            engine.config.url + "/v1/completions",
            orjson.dumps(body),
            engine_headers(engine.config.resolved_api_key(), f"narwhal-probe-{engine.id}"),
            self._cfg.engine.probe_timeout_s,
            timeout_class=FailureClass.STREAM,
        )
        if reply.status != 200:
            cls = classify_status(reply.status) or FailureClass.INFERENCE_STATUS
            raise EngineFailure(
                cls, f"prefill leg answered HTTP {reply.status}", status=reply.status
            )
        try:
            parsed = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            parsed = None
        result = vllm.extract_handoff(parsed)
        if not isinstance(result, vllm.Handoff):
            reason = result.reason if isinstance(result, vllm.Unreadable) else "no handoff"
            raise EngineFailure(FailureClass.KV_HANDOFF, f"prefill leg: {reason}")
        return result

    async def decode_leg(self, engine: EngineState, body: dict[str, Any]) -> None:
        """Run a streamed leg to its terminal marker within the probe timeout."""
        session = self._client.session(PoolKind.CONTROL)
        headers = engine_headers(engine.config.resolved_api_key(), f"narwhal-probe-{engine.id}")
        scanner = SseScanner()
        try:
            async with asyncio.timeout(self._cfg.engine.probe_timeout_s):
                async with session.post(
                    engine.config.url + "/v1/completions", data=orjson.dumps(body), headers=headers
                ) as resp:
                    if resp.status != 200:
                        cls = classify_status(resp.status) or FailureClass.INFERENCE_STATUS
                        raise EngineFailure(
                            cls, f"decode leg answered HTTP {resp.status}", status=resp.status
                        )
                    async for chunk in resp.content.iter_any():
                        scanner.feed(chunk)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise classify_exception(exc, FailureClass.STREAM) from None
        if scanner.malformed or not scanner.done:
            raise EngineFailure(FailureClass.STREAM, "decode leg ended without [DONE]")
