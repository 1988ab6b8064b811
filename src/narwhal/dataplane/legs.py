"""The legs' I/O: a prefill, a decode taking its handoff, the final leg whose answer is the
client's, an embeddings request. Each leg's outcome is classified once and reported to the
evidence sink here; streams are relayed by `stream_leg.py`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import orjson

from narwhal.config import ServingConfig
from narwhal.dataplane.exchange import Answer
from narwhal.dataplane.leg import Leg
from narwhal.dataplane.outcomes import (
    DeadlineExceeded,
    Saturated,
    client_error_body,
    finished_response,
)
from narwhal.dataplane.requests import ClientRequest, EmbeddingsRequest
from narwhal.engine.adapter import (
    PATHS,
    FinishedInPrefill,
    HandoffRefused,
    SlotsBusy,
    Unreadable,
)
from narwhal.engine.failures import (
    ClientError,
    EngineFailure,
    FailureClass,
    SuccessKind,
    classify_status,
)
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient, PoolKind
from narwhal.fleet.evidence_sink import EvidenceSink
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.state import EngineState
from narwhal.telemetry.metrics import Children, DataMetrics


class Legs:
    """What every leg needs: the engine client, the adapters, evidence, metrics and the
    serving config in force (`serving`, replaced on reload)."""

    def __init__(
        self,
        client: EngineClient,
        adapters: Adapters,
        evidence: EvidenceSink,
        metrics: DataMetrics,
        stats: IntervalStats,
        serving: ServingConfig,
    ) -> None:
        self.client = client
        self.adapters = adapters
        self.evidence = evidence
        self.metrics = metrics
        self.stats = stats
        self.serving = serving
        self._outcomes = Children(metrics.leg_outcomes)

    # ------------------------------------------------------------ evidence
    def fail(self, engine: EngineState, leg: str, failure: EngineFailure) -> EngineFailure:
        self._outcomes(engine.id, leg, failure.failure_class.value).inc()
        self.evidence.failure(engine.id, failure, leg)
        return failure

    def succeed(self, engine: EngineState, leg: str, kind: SuccessKind) -> None:
        self._outcomes(engine.id, leg, kind.value).inc()
        self.evidence.success(engine.id, kind, leg)

    def status_failure(
        self, engine: EngineState, leg: str, status: int, body: bytes, content_type: str
    ) -> Exception:
        """An engine's non-200 answer, classified: the client's 4xx, overload, or a failure."""
        failure_class = classify_status(status, body)
        if failure_class is None:
            self.succeed(engine, leg, SuccessKind.CLIENT_4XX)
            if status >= 500:  # a vLLM-style 500 for a prompt too long: the client's 400
                return ClientError(400, client_error_body(body), "application/json")
            return ClientError(status, body, content_type)
        failure = self.fail(
            engine, leg, EngineFailure(failure_class, f"HTTP {status}", status=status)
        )
        if failure_class is FailureClass.OVERLOAD:
            return Saturated(f"engine {engine.id} answered {status}")
        return failure

    def check_recompute(self, leg: Leg, final: bytes | None) -> None:
        """A decode that recomputed the prompt answered correctly but hid an unusable
        handoff: record it against the handoff's producer (DESIGN §1)."""
        if leg.producer is None:
            return
        reason = self.adapters(leg.engine.config).recomputed(final)
        if reason is not None:
            leg.attempt.handoff_failed = True
            self.fail(leg.producer, "prefill", EngineFailure(FailureClass.KV_HANDOFF, reason))

    def _first_byte_limit(self, deadline: float, now: float) -> float:
        remaining = deadline - now
        if remaining <= 0:
            raise DeadlineExceeded()
        return min(self.serving.first_token_timeout_s, remaining)

    # ------------------------------------------------------------ legs
    async def prefill(self, req: ClientRequest, leg: Leg, now: float) -> object:
        """The extracted handoff, or the whole answer when the prefill finished the request."""
        limit = self._first_byte_limit(leg.deadline, now)
        engine = leg.engine
        adapter = self.adapters(engine.config)
        self.stats.request(engine.id)
        leg_start = time.perf_counter()
        try:
            reply = await adapter.prefill(
                PoolKind.DATA, engine.config, req.endpoint, leg.body, leg.headers, limit
            )
        except EngineFailure as exc:
            raise self.fail(engine, "prefill", exc) from None
        except SlotsBusy as exc:
            raise Saturated(str(exc)) from None
        if reply.status != 200:
            raise self.status_failure(
                engine, "prefill", reply.status, reply.body, reply.content_type
            )
        result = reply.result
        if isinstance(result, Unreadable):
            raise self.fail(
                engine, "prefill", EngineFailure(FailureClass.KV_HANDOFF, result.reason)
            )
        if isinstance(result, FinishedInPrefill):
            self.succeed(engine, "prefill", SuccessKind.PREFILL_FINISHED)
            assert isinstance(reply.parsed, dict)
            return finished_response(req, reply.parsed)
        self.stats.latency(engine.id, time.perf_counter() - leg_start)
        if not adapter.decode_verifies_handoff:
            # Recorded now: deferred to the end of a long stream, it would erase failures
            # the prefill had since (otherwise see `DataPlane._attempt`).
            self.succeed(engine, "prefill", SuccessKind.PREFILL_HANDOFF)
        return result

    @asynccontextmanager
    async def decode_body(
        self, req: ClientRequest, leg: Leg, handoff: object, now: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The decode engine takes the handoff: the final leg's body, for as long as the
        block runs (an adapter may hold the handoff's slot until then)."""
        assert leg.producer is not None
        limit = self._first_byte_limit(leg.deadline, now)
        engine = leg.engine
        adapter = self.adapters(engine.config)
        async with AsyncExitStack() as stack:
            try:
                body = await stack.enter_async_context(
                    adapter.decode(
                        PoolKind.DATA, engine.config, req.body, handoff, leg.headers, limit
                    )
                )
            except HandoffRefused as exc:
                leg.attempt.handoff_failed = True
                failure = EngineFailure(FailureClass.KV_HANDOFF, str(exc))
                raise self.fail(leg.producer, "prefill", failure) from None
            except EngineFailure as exc:
                raise self.fail(engine, "decode", exc) from None
            except SlotsBusy as exc:
                raise Saturated(str(exc)) from None
            yield body

    async def final_json(self, req: ClientRequest, leg: Leg, now: float) -> Answer:
        """An unstreamed final leg: the engine's whole answer is the client's."""
        engine = leg.engine
        remaining = leg.deadline - now
        if remaining <= 0:
            raise DeadlineExceeded()
        self.stats.request(engine.id)
        url = engine.config.url + PATHS[req.endpoint]
        leg_start = time.perf_counter()
        try:
            data = orjson.dumps(leg.body)
            reply = await self.client.post(PoolKind.DATA, url, data, leg.headers, remaining)
        except EngineFailure as exc:
            raise self.fail(engine, leg.name, exc) from None
        if reply.status != 200:
            raise self.status_failure(
                engine, leg.name, reply.status, reply.body, reply.content_type
            )
        # The answer is the leg's first byte, as a stream's first chunk is: the same latency
        # sample (drift compares engines of a role on it).
        self.stats.latency(engine.id, time.perf_counter() - leg_start)
        self.succeed(engine, leg.name, SuccessKind.DECODE_DONE)
        self.check_recompute(leg, reply.body)
        return Answer(200, reply.body, reply.content_type)

    async def embed(self, req: EmbeddingsRequest, leg: Leg, now: float) -> Answer:
        """One embed engine's answer. The engine has `first_token_timeout_s` to answer whole
        (an embedding is one forward pass, like a first token); when the request's own
        deadline is nearer, running out is the request's, not the engine's."""
        timeout_s = self._first_byte_limit(leg.deadline, now)
        engine = leg.engine
        try:
            reply = await self.client.post(
                PoolKind.DATA, engine.config.url + "/v1/embeddings", req.raw, leg.headers, timeout_s
            )
        except EngineFailure as exc:
            if exc.failure_class is FailureClass.TIMEOUT and timeout_s < (
                self.serving.first_token_timeout_s
            ):
                raise DeadlineExceeded() from None
            raise self.fail(engine, "embed", exc) from None
        if reply.status != 200:
            raise self.status_failure(engine, "embed", reply.status, reply.body, reply.content_type)
        self.succeed(engine, "embed", SuccessKind.EMBEDDED)
        return Answer(200, reply.body, reply.content_type or "application/json", "ok")
