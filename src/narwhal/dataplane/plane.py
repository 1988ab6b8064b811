"""The request path's entry and its hot path: authentication, the body, admission, then the
serving policy over attempts (`policy.py`), each attempt placing a prefill and a decode (or
one unified leg) and running them (`legs.py`, `stream_leg.py`).

`DataPlane` wires the rest, each in its own module with the few collaborators it needs:
each leg's engine (`placer.py`), embeddings (`embeddings.py`), batched prompts and `n > 1`
(`fanout_runner.py` over `fanout.py`), a broken stream continued elsewhere
(`continuation.py` over `migration.py`), prompt-length checks (`token_limits.py`),
`/tokenize` and `/detokenize` (`passthrough.py`), leg spans (`spans.py`) and the engines'
API keys (`engine_calls.py`).

A proxied stream owns its accounting: in-flight counts and evidence are recorded exactly once
whether the stream ends, fails, or the client leaves (a client that leaves records nothing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Literal, Protocol

import orjson

from narwhal.clock import Clock
from narwhal.config import Config, Role
from narwhal.dataplane.access_log import AccessLog
from narwhal.dataplane.auth import ApiKeys, KeysUnreadable, load_keys
from narwhal.dataplane.body import read_body, size_before_key
from narwhal.dataplane.continuation import Continuations
from narwhal.dataplane.embeddings import Embeddings
from narwhal.dataplane.engine_calls import EngineKeys
from narwhal.dataplane.errors import error_answer, error_body
from narwhal.dataplane.exchange import Answer, Exchange, Result
from narwhal.dataplane.fanout_runner import FanOut
from narwhal.dataplane.flow_gate import FlowGate
from narwhal.dataplane.leg import Attempt, Leg
from narwhal.dataplane.legs import Legs
from narwhal.dataplane.migration import Splice, migratable
from narwhal.dataplane.moves import Moves
from narwhal.dataplane.outcomes import (
    DeadlineExceeded,
    Interrupted,
    Moved,
    NoCapacity,
    Saturated,
    bad_request,
    failure_response,
    reason,
    settled,
)
from narwhal.dataplane.passthrough import Passthrough
from narwhal.dataplane.placer import Placer
from narwhal.dataplane.policy import (
    Limits,
    Next,
    Outcome,
    StepAside,
    after_attempt,
    limits_for,
    step_aside,
)
from narwhal.dataplane.pool import Pool, PoolExhausted
from narwhal.dataplane.prefix import PrefixPlacement
from narwhal.dataplane.record import TRACE_HEADERS, RequestRecord, client_request_id
from narwhal.dataplane.requests import (
    BadRequest,
    ClientRequest,
    EmbeddingsRequest,
    parse_embeddings,
    parse_request,
)
from narwhal.dataplane.spans import Spans
from narwhal.dataplane.stream_leg import Streams
from narwhal.dataplane.token_limits import TokenLimits
from narwhal.dataplane.tokens import TokenBudget
from narwhal.engine.adapter import PATHS, Endpoint
from narwhal.engine.failures import ClientError, EngineFailure, SuccessKind
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient, engine_headers
from narwhal.fleet.evidence_sink import EvidenceSink
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.telemetry.events import Note
from narwhal.telemetry.metrics import Children, DataMetrics
from narwhal.telemetry.timeline import Timeline
from narwhal.telemetry.tracing import make_tracer

log = logging.getLogger("narwhal.proxy")


def _unnoted(kind: str, engine_id: str | None, what: str) -> None:
    """No timeline (a data plane built on its own, as in unit tests)."""


Route = Endpoint | Literal["embeddings"]
"""What `handle` serves: a PD generation, or embeddings (passed to an embed engine)."""


class Gate(Protocol):
    """Whether new requests are admitted: `Admission` in one process, a worker's snapshot of
    it (with its own expiry) in each worker."""

    def closed_reason(self) -> str | None: ...


class DataPlane:
    _flow: FlowGate | None = None  # flow control's data-plane side, set by the process

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        client: EngineClient,
        evidence: EvidenceSink,
        metrics: DataMetrics,
        clock: Clock,
        admission: Gate,
        new_request_id: Callable[[], str],
        adapters: Adapters,
        stats: IntervalStats | None = None,
        timeline: Timeline | None = None,
        pool: Pool | None = None,
        note: Note | None = None,
        prefix: PrefixPlacement | None = None,
    ) -> None:
        """`note` puts an event on the control process's timeline (telemetry/events.py):
        migrations happen here, in the data plane."""
        self._fleet = fleet
        self._evidence = evidence
        self._metrics = metrics
        self._clock = clock
        self._admission = admission
        self._new_id = new_request_id
        self._adapters = adapters
        self._stats = stats or IntervalStats(config.controller.interval_s, clock.monotonic())
        self._timeline = timeline or Timeline()
        self.pool = pool or Pool("data", config.serving.max_connections)
        self._engine_keys = EngineKeys()
        self._requests = Children(metrics.requests)
        self._latency = Children(metrics.total_latency)
        self._moves = Moves()
        self._legs = Legs(client, adapters, evidence, metrics, self._stats, config.serving)
        self._streams = Streams(self._legs, self._moves, clock)
        self._prefix = prefix or PrefixPlacement(config, clock)
        self._placer = Placer(config, fleet, clock, self._prefix, metrics)
        self._keys = ApiKeys(load_keys(config.auth)) if config.auth.enabled else None
        self._by_key = Children(metrics.key_requests)
        self._ids_by = adapters.of_api(config.fleet_api).token_ids_by  # one API per fleet
        self._tracer = make_tracer(config.tracing)  # None: not traced, and nothing paid
        self._spans = Spans(self._tracer)
        key_of = self._engine_keys.of
        self._token_limits = TokenLimits(
            fleet,
            client,
            clock,
            key_of,
            TokenBudget(config.serving.token_count_cache_size),
            Children(metrics.token_checks),
            config,
        )
        self._passthrough = Passthrough(fleet, client, clock, key_of, new_request_id, config)
        self._embeddings = Embeddings(
            fleet, clock, self._placer.placed, self._spans.leg, self._leg, self._legs.embed,
            metrics.retries,
        )  # fmt: skip
        self._fan_out = FanOut(self.pool, self._serve)
        self._continuations = Continuations(
            fleet,
            clock,
            adapters,
            key_of,
            new_request_id,
            self._attempt,
            self._streams.error_event,
            evidence.settled,
            Children(metrics.migrations),
            Children(metrics.migrated_streams),
            note or _unnoted,
            config,
            self._resume,
        )
        self._apply(config)

    @property
    def flow(self) -> FlowGate | None:
        return self._flow

    @flow.setter
    def flow(self, gate: FlowGate) -> None:
        """Flow control's data-plane side: asks to start, and may ask a stream to step aside."""
        self._flow = gate
        gate.preempt = self.preempt

    def _apply(self, config: Config) -> None:
        """What a config sets for new requests (at start, and on every reload)."""
        self._cfg = config
        self._serving = self._legs.serving = config.serving
        self._token_limits.config = self._passthrough.config = config
        self._continuations.config = config
        self._limits: Limits = limits_for(
            config.serving.policy, config.serving.max_attempts, config.serving.migrations
        )
        every = config.logging.access_every
        self._access = AccessLog(every) if every is not None else None
        self._placer.apply(config)

    def reconfigure(self, config: Config) -> None:
        """A reloaded config (control/reload.py): timeouts, policies, the access log and the
        client keys for new requests. What sizes the pool and caches stays as built (a
        reload reports it)."""
        self._apply(config)
        try:
            self._keys = ApiKeys(load_keys(config.auth)) if config.auth.enabled else None
        except KeysUnreadable as exc:  # gone since the control process checked it
            log.error("reload: keeping the API keys in use: %s", exc)

    def authenticate(self, authorization: str | None) -> tuple[Answer | None, str | None]:
        """(None, the key's label) when `/v1/*` may be served (auth off: no label; a known
        key: counted under its label); else the 401 to send."""
        if self._keys is None:
            return None, None
        label = self._keys.label(authorization)
        if label is not None:
            self._by_key(label).inc()
            return None, label
        message = (
            "Incorrect API key provided."
            if authorization
            else "No API key provided: send `Authorization: Bearer <key>`."
        )
        body = error_body(message, "invalid_request_error", "invalid_api_key")
        headers = {"WWW-Authenticate": "Bearer"}
        return Answer(401, body, "application/json", "unauthorized", headers), None

    def move_streams(self, engine_id: str) -> int:
        """Migrate every stream decoding on `engine_id` now: the stream goes on elsewhere
        with no evidence against the engine (planned maintenance with `migrate`). Returns how
        many were moved."""
        return self._moves.move(engine_id)

    def preempt(self, request_id: str) -> StepAside:
        """Flow control asks the stream of `request_id` to step aside for a more urgent
        request: cut its decode leg off, to go on once the queue grants it a slot again.
        Only a begun stream with a migration left and tokens still to generate can; one not
        reading its answer yet (between legs, before its first byte, or already moving) may
        be asked again later."""
        attempt = self._moves.reading(request_id)
        if attempt is None:
            return StepAside.NOT_YET
        splice = attempt.splice
        if splice is None:
            return StepAside.NEVER
        generating = not (splice.finished or splice.done)
        answer = step_aside(attempt.started, splice.migrations, generating, self._limits)
        if answer is StepAside.NOW and not self._moves.preempt(request_id):
            return StepAside.NOT_YET
        return answer

    async def _resume(self, deadline: float) -> None:
        """A preempted stream waits for its turn to go on (`FlowGate.resume`)."""
        if self._flow is not None:
            await self._flow.resume(deadline)

    # ---------------------------------------------------------------- entry point
    async def handle(self, endpoint: Route, exchange: Exchange) -> Result:
        """Serve one request; the server sends an `Answer` once this returns. Every answer
        carries the request's id (`X-Request-Id`)."""
        start = self._clock.monotonic()
        record = exchange.record = self._record(endpoint, exchange)
        if self._tracer is not None:
            attributes = {"narwhal.request_id": record.request_id, "narwhal.endpoint": endpoint}
            record.span = self._tracer.request(record.trace, attributes)
        outcome = "ok"
        try:
            refused, record.key = self.authenticate(exchange.header("authorization"))
            if refused is not None:
                refused = await size_before_key(exchange, self._serving.max_body_bytes, refused)
            result = refused or await self._handle(endpoint, exchange, start)
            outcome = result.outcome
            await self._evidence.settled()  # what this request taught is applied first
            if isinstance(result, Answer):
                headers = {**result.headers} if result.headers else {}
                headers["X-Request-Id"] = record.request_id
                result = Answer(  # not `replace`: a dozen calls on every request
                    result.status, result.body, result.content_type, result.outcome, headers
                )
                record.status = result.status
                if result.status == 200:
                    record.usage_source = result.body
            else:
                record.status = 200
            return result
        except asyncio.CancelledError:
            # A client that leaves after its stream's `[DONE]` was served: the outcome stands.
            outcome = exchange.settled_outcome or "client_disconnect"
            raise
        finally:
            elapsed = self._clock.monotonic() - start
            self._requests(endpoint, outcome).inc()
            self._latency(endpoint).observe(elapsed)
            self._timeline.request(outcome, elapsed)
            if self._access is not None:
                record.outcome, record.duration_s = outcome, elapsed
                self._access.log(record)
            if record.span is not None:
                self._spans.end(record, outcome)

    async def passthrough(self, path: str, exchange: Exchange) -> Answer:
        """`/tokenize` and `/detokenize` (vLLM's, `passthrough.py`): the client's body to one
        engine of its model, its answer the client's; authenticated and counted here."""
        name = path.strip("/")
        start = self._clock.monotonic()
        answer, _ = self.authenticate(exchange.header("authorization"))
        if answer is not None:
            answer = await size_before_key(exchange, self._serving.max_body_bytes, answer)
        else:
            answer = await self._passthrough.answer(path, exchange)
        self._requests(name, answer.outcome).inc()
        self._latency(name).observe(self._clock.monotonic() - start)
        return answer

    def explain_placement(self, raw: bytes) -> Answer:
        """`POST /admin/placement`: a completions or chat body's placement now, not run."""
        try:
            probe = orjson.loads(raw)
            chat = isinstance(probe, dict) and "messages" in probe
            req = parse_request("chat" if chat else "completions", raw, self._cfg.model)
            model = req.model or self._cfg.model
            if not self._fleet.knows_model(model):
                raise BadRequest(
                    404, f"The model `{model}` does not exist.", param="model",
                    type_="NotFoundError", code="model_not_found",
                )  # fmt: skip
            if self._fleet.needed_roles(model) == (Role.EMBED,):
                message = f"The model `{model}` serves embeddings only"
                raise BadRequest(400, message, param="model", code="model_not_supported")
        except orjson.JSONDecodeError as exc:
            return bad_request(BadRequest(400, f"request body is not valid JSON: {exc}"))
        except BadRequest as exc:
            return bad_request(exc)
        view = self._prefix.explain(req, model, self._fleet, self._clock.monotonic())
        return Answer(200, orjson.dumps(view), "application/json")

    @property
    def prefix(self) -> PrefixPlacement:
        """Cache-aware placement: its `run` belongs in the process's task group."""
        return self._prefix

    async def close(self) -> None:
        """Send the spans still batched (tracing on)."""
        await self._spans.close()

    def _record(self, endpoint: Route, exchange: Exchange) -> RequestRecord:
        """The request's id (the client's `X-Request-Id` when usable) and trace context."""
        client = client_request_id(exchange.header("x-request-id"))
        request_id = client or self._new_id()
        base = request_id if client is None else f"{client}-{self._new_id()}"
        record = RequestRecord(request_id, endpoint, base)
        for name in TRACE_HEADERS:
            value = exchange.header(name)
            if value is not None:
                record.trace[name] = value
        return record

    async def _handle(self, endpoint: Route, exchange: Exchange, start: float) -> Result:
        # The body first: a request that is wrong whatever the router's state gets its 4xx
        # even while admission is closed (a 503 would tell the client to retry it as is).
        try:
            raw = await read_body(exchange, self._serving.max_body_bytes)
            req: ClientRequest | EmbeddingsRequest
            if endpoint == "embeddings":
                req = parse_embeddings(raw, self._cfg.model)
            else:
                req = parse_request(endpoint, raw, self._cfg.model)
            if exchange.record is not None:
                exchange.record.model = req.model
            if req.model is not None and not self._fleet.knows_model(req.model):
                raise BadRequest(
                    404,
                    f"The model `{req.model}` does not exist.",
                    param="model",
                    type_="NotFoundError",
                    code="model_not_found",
                )
        except BadRequest as exc:
            return bad_request(exc)
        closed = self._admission.closed_reason()
        if closed is not None:
            return error_answer(
                503,
                f"not admitting requests: {closed}",
                "service_unavailable",
                "not_admitted",
                retry_after_s=1,
            )
        deadline = start + self._serving.request_timeout_s
        ticket = None
        flow = self._flow
        if flow is not None and flow.active:  # flow control (DESIGN §13): may it start now?
            key = exchange.record.key if exchange.record is not None else None
            admitted = await flow.admit(req, exchange, deadline, key)
            if isinstance(admitted, Answer):
                return admitted
            ticket = admitted
        bounded = self._serving.policy == "bounded"
        try:
            if bounded:
                await self.pool.acquire(
                    deadline - self._clock.monotonic(), self._serving.queue_limit
                )
            elif not self.pool.try_acquire():
                raise PoolExhausted("data pool exhausted")
        except PoolExhausted:
            if ticket is not None:
                ticket.finish(None, None)
            return error_answer(
                503,
                "server saturated: no data connection available",
                "service_unavailable",
                "saturated",
                retry_after_s=1,
            )
        result: Result | None = None
        try:
            if isinstance(req, EmbeddingsRequest):
                result = await self._embeddings.answer(req, exchange, deadline, self._limits)
            elif req.n > 1 or req.batch is not None:
                result = await self._fan_out.answer(req, exchange, deadline)
            else:
                result = await self._serve(req, exchange, deadline)
        finally:
            self.pool.release()
            if ticket is not None:  # it ended: its tokens, and its key's x-ratelimit-*
                usage = exchange.record.usage_source if exchange.record else None
                result = ticket.finish(result, usage)
        assert result is not None  # an exception would have left above
        return result

    # ---------------------------------------------------------------- policy
    async def _serve(self, req: ClientRequest, exchange: Exchange, deadline: float) -> Result:
        """Attempts until one answers or the policy gives up (`policy.after_attempt`)."""
        tried: set[str] = set()
        last: Exception | None = None
        may_migrate = (
            self._limits.migrations > 0 and req.stream and migratable(req.endpoint, req.body)
        )
        client_req = req
        record = exchange.record
        assert record is not None  # `handle` made it
        number = 0
        interrupted: Interrupted | None = None
        while True:
            splice = None
            if may_migrate:  # each attempt from scratch: nothing reached the client yet
                splice = Splice(
                    client_req.endpoint, client_req.body, client_req.include_usage, self._ids_by
                )
                req = replace(client_req, body=splice.first_body())
            attempt = Attempt(record.next_attempt_id(), record.trace, splice=splice)
            try:
                if number == 0:
                    await self._token_limits.check(req, deadline, attempt)
                return await self._attempt(req, exchange, deadline, attempt, tried)
            except BadRequest as exc:
                return bad_request(exc)
            except (ClientError, NoCapacity, DeadlineExceeded) as exc:
                return settled(exc)
            except Interrupted as exc:
                interrupted, outcome = exc, Outcome.INTERRUPTED
            except (EngineFailure, Saturated, Moved) as exc:
                last = exc
                outcome = Outcome.FAILED_STARTED if attempt.started else Outcome.RETRYABLE
            now = self._clock.monotonic()
            step = after_attempt(outcome, number, self._limits, now, deadline)
            if step is Next.MIGRATE:
                assert splice is not None and interrupted is not None
                return await self._continuations.migrate(
                    exchange, deadline, splice, interrupted, tried, self._limits
                )
            if step is not Next.RETRY:
                return failure_response(last)
            self._metrics.retries.labels(reason(last)).inc()  # type: ignore[arg-type]
            number += 1

    def _leg(
        self,
        name: str,
        engine: EngineState,
        attempt: Attempt,
        deadline: float,
        body: dict[str, Any],
        producer: EngineState | None = None,
    ) -> Leg:
        key = self._engine_keys.of(engine.config)
        headers = engine_headers(key, attempt.request_id, attempt.trace)
        return Leg(name, engine, attempt, deadline, headers, body, producer)

    @staticmethod
    def _placed_on(exchange: Exchange, prefill: str | None, decode: str | None) -> None:
        """The engines of the request's latest attempt, for its access-log line."""
        record = exchange.record
        if record is not None:
            record.prefill, record.decode = prefill, decode

    # ---------------------------------------------------------------- one attempt
    async def _attempt(
        self,
        req: ClientRequest,
        exchange: Exchange,
        deadline: float,
        attempt: Attempt,
        tried: set[str],
    ) -> Result:
        model = req.model
        roles = self._fleet.needed_roles(model)
        if roles == (Role.EMBED,):
            raise BadRequest(
                400, f"The model `{model}` serves embeddings only (/v1/embeddings)",
                param="model", code="model_not_supported",
            )  # fmt: skip
        prefix = self._prefix
        prompt = await prefix.prompt(req, model or self._cfg.model) if prefix.enabled else None
        cached = prefix.match(prompt) if prompt is not None else None
        if roles == (Role.BOTH,):
            with (
                self._placer.placed(Role.BOTH, tried, model, prompt, cached) as engine,
                self._spans.leg(exchange, attempt, "unified", engine.id),
            ):
                self._placed_on(exchange, None, engine.id)
                body = self._adapters(engine.config).unified_body(req.body)
                leg = self._leg("unified", engine, attempt, deadline, body)
                return await self._final(req, exchange, leg)
        now = self._clock.monotonic()
        # Never spend a prefill whose KV nobody can read; /ready's precedence (readiness.py):
        # a role not yet verified (starting) before a role without capacity.
        prefills = self._fleet.candidates(Role.PREFILL, now, model)
        decodes = self._fleet.candidates(Role.DECODE, now, model)
        missing = [r for r, c in ((Role.PREFILL, prefills), (Role.DECODE, decodes)) if not c]
        if missing:
            starting = [r for r in missing if not self._fleet.has_verified(r, model)]
            raise NoCapacity(starting[0], True) if starting else NoCapacity(missing[0])
        placer = self._placer
        if placer.refuse_full and not placer.below_limits(decodes, now)[1]:
            raise Saturated("every eligible decode engine is full")  # nor spend a prefill
        with (
            placer.placed(Role.PREFILL, tried, model, prompt, cached) as prefill,
            self._spans.leg(exchange, attempt, "prefill", prefill.id),
        ):
            self._placed_on(exchange, prefill.id, None)
            leg = self._leg("prefill", prefill, attempt, deadline, req.body)
            handoff = await self._legs.prefill(req, leg, self._clock.monotonic())
        if isinstance(handoff, Answer):
            return await self._continuations.finished_in_prefill(
                exchange, deadline, attempt, handoff
            )
        try:
            with (
                placer.placed(Role.DECODE, tried, model, prompt, cached) as decode,
                self._spans.leg(exchange, attempt, "decode", decode.id),
            ):
                self._placed_on(exchange, prefill.id, decode.id)
                leg = self._leg("decode", decode, attempt, deadline, req.body, producer=prefill)
                async with self._legs.decode_body(
                    req, leg, handoff, self._clock.monotonic()
                ) as body:
                    return await self._final(req, exchange, leg.with_body(body))
        finally:
            # Where only the decode can judge the handoff, the prefill's success (which clears
            # kv_handoff evidence) counts once the decode did not refuse it or recompute the
            # prompt; recorded first, it would reset every kv_handoff streak and the streak
            # would never reach eject_after. A decode failing for another reason leaves the
            # prefill's success standing.
            adapter = self._adapters(prefill.config)
            if adapter.decode_verifies_handoff and not attempt.handoff_failed:
                self._legs.succeed(prefill, "prefill", SuccessKind.PREFILL_HANDOFF)
            await adapter.discard(prefill.config, handoff)

    def _final(self, req: ClientRequest, exchange: Exchange, leg: Leg) -> Awaitable[Result]:
        """The leg whose answer goes to the client (its coroutine: no frame of its own on
        every request's path)."""
        if not req.stream:
            return self._legs.final_json(req, leg, self._clock.monotonic())
        url = leg.engine.config.url + PATHS[req.endpoint]
        return self._streams.run(exchange, leg, url)
