"""The request path: admission, validation, placement, the prefill leg, the decode leg.

Each leg's outcome is classified once and reported to the evidence sink. A proxied stream
owns its accounting: in-flight counts and evidence are recorded exactly once whether the
stream ends, fails, or the client leaves (a client that leaves records nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, AsyncExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import orjson

from narwhal.clock import Clock
from narwhal.config import Config, EngineConfig, Role
from narwhal.dataplane.access_log import AccessLog
from narwhal.dataplane.auth import ApiKeys, KeysUnreadable, load_keys
from narwhal.dataplane.errors import error_answer, error_body, sse_error_event
from narwhal.dataplane.exchange import Answer, Exchange, Result, Streamed
from narwhal.dataplane.fanout import PARALLEL, merge, split
from narwhal.dataplane.migration import Continuation, Splice, migratable
from narwhal.dataplane.placement import least_in_flight
from narwhal.dataplane.pool import Pool, PoolExhausted
from narwhal.dataplane.record import TRACE_HEADERS, RequestRecord, client_request_id
from narwhal.dataplane.requests import (
    BadRequest,
    ClientRequest,
    EmbeddingsRequest,
    parse_embeddings,
    parse_request,
)
from narwhal.dataplane.sse import SseScanner
from narwhal.dataplane.tokens import TokenBudget
from narwhal.dataplane.watchdog import ReadWatchdog
from narwhal.engine.adapter import (
    PATHS,
    Endpoint,
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
from narwhal.engine.h1 import EngineResponse
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient, PoolKind, classify_exception, engine_headers
from narwhal.fleet.evidence_sink import EvidenceSink
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.readiness import starting_reason
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.telemetry.events import Note
from narwhal.telemetry.metrics import Children, DataMetrics
from narwhal.telemetry.timeline import Timeline
from narwhal.telemetry.tracing import make_tracer

log = logging.getLogger("narwhal.proxy")

_UNTRACED = nullcontext()  # an untraced leg's span
# A write to a client that left (aiohttp's ClientConnectionResetError is one too).
_CLIENT_GONE = ConnectionResetError
# How long to wait, after [DONE], for the end of the engine's body so its connection can be
# reused. The client's response is already complete; past this the connection is closed.
_EOF_AFTER_DONE_S = 0.1


def _unnoted(kind: str, engine_id: str | None, what: str) -> None:
    """No timeline (a data plane built on its own, as in unit tests)."""


Route = Endpoint | Literal["embeddings"]
"""What `handle` serves: a PD generation, or embeddings (passed to an embed engine)."""


class Gate(Protocol):
    """Whether new requests are admitted: `Admission` in one process, a worker's snapshot of
    it (with its own expiry) in each worker."""

    def closed_reason(self) -> str | None: ...


class NoCapacity(Exception):
    """No eligible engine of `role`: `starting` when none was ever verified (DESIGN §10)."""

    def __init__(self, role: Role, starting: bool = False) -> None:
        super().__init__(starting_reason(role) if starting else f"no capacity: {role.value}")
        self.role = role


class Saturated(Exception):
    """The chosen engine or the data pool cannot take the request now."""


class ClientGone(Exception):
    """The client disconnected; nothing is recorded against any engine."""


class DeadlineExceeded(Exception):
    """The request's own deadline ran out while the engine was making progress."""


class Moved(Exception):
    """The operator moved the stream off its decode engine (planned maintenance with
    `migrate`) before the stream's first byte: the policy retries it elsewhere, and the engine
    is charged nothing."""


class _PartFailed(Exception):
    """A part of a fanned-out request was not answered 200 (its answer is the request's)."""


class Interrupted(Exception):
    """A leg failed after the client's stream began, and the stream can be continued
    (`dataplane/migration.py`); the engine has its evidence already."""

    def __init__(self, failure: EngineFailure, cause: str, engine_id: str) -> None:
        super().__init__(cause)
        self.failure = failure
        self.cause = cause
        self.engine_id = engine_id  # the engine the stream left


@dataclass(slots=True, eq=False)  # hashed by identity: a key of `_movable`
class _Attempt:
    """One prefill/decode attempt; `started` flips once this attempt sent the client bytes.
    `splice` follows a stream that may be migrated, across attempts."""

    request_id: str
    trace: Mapping[str, str]  # the client's trace context, for both legs
    started: bool = False
    handoff_failed: bool = False  # the decode refused the handoff or recomputed the prompt
    splice: Splice | None = None
    moved: bool = False  # the operator moved the stream off its decode engine


class DataPlane:
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
    ) -> None:
        """`note` puts an event on the control process's timeline (telemetry/events.py):
        migrations happen here, in the data plane."""
        self._fleet = fleet
        self._note = note or _unnoted
        self._in_flight_counts = fleet.in_flight
        self._client = client
        self._evidence = evidence
        self._metrics = metrics
        self._clock = clock
        self._admission = admission
        self._new_id = new_request_id
        self._adapters = adapters
        self._stats = stats or IntervalStats(config.controller.interval_s, clock.monotonic())
        self._timeline = timeline or Timeline()
        self.pool = pool or Pool("data", config.serving.max_connections)
        self._tokens = TokenBudget(config.serving.token_count_cache_size)
        # Each engine's API key, by id, with the config it was read from (members change).
        self._api_keys: dict[str, tuple[EngineConfig, str | None]] = {}
        self._requests = Children(metrics.requests)
        self._latency = Children(metrics.total_latency)
        self._token_checks = Children(metrics.token_checks)
        self._leg_outcomes = Children(metrics.leg_outcomes)
        self._migrations_by = Children(metrics.migrations)
        self._migrated = Children(metrics.migrated_streams)
        # The streams that may migrate, by the engine they decode on: `move_streams` expires
        # their read timers.
        self._movable: dict[str, dict[_Attempt, asyncio.Timeout]] = {}
        self._keys = ApiKeys(load_keys(config.auth)) if config.auth.enabled else None
        self._by_key = Children(metrics.key_requests)
        self._ids_by = adapters.of_api(config.fleet_api).token_ids_by  # one API per fleet
        self._tracer = make_tracer(config.tracing)  # None: not traced, and nothing paid
        self._apply(config)

    def _apply(self, config: Config) -> None:
        """What a config sets for new requests (at start, and on every reload)."""
        self._cfg = config
        self._serving = config.serving
        self._migration_limit = config.serving.migrations
        every = config.logging.access_every
        self._access = AccessLog(every) if every is not None else None

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

    def _key(self, config: EngineConfig) -> str | None:
        """The engine's API key (read once per config: `api_key_env` reads the environment)."""
        cached = self._api_keys.get(config.id)
        if cached is None or cached[0] is not config:
            cached = self._api_keys[config.id] = (config, config.resolved_api_key())
        return cached[1]

    def move_streams(self, engine_id: str) -> int:
        """Migrate every stream decoding on `engine_id` now: each one's read ends as if it
        had timed out, and the stream goes on elsewhere with no evidence against the engine
        (planned maintenance with `migrate`). Returns how many were moved."""
        streams = self._movable.get(engine_id, {})
        for attempt, timer in streams.items():
            attempt.moved = True
            timer.reschedule(asyncio.get_running_loop().time())
        if streams:
            log.info("moving %d streams off %s (planned maintenance)", len(streams), engine_id)
        return len(streams)

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
            result = refused or await self._handle(endpoint, exchange, start)
            outcome = result.outcome
            await self._evidence.settled()  # what this request taught is applied first
            if isinstance(result, Answer):
                headers = {**result.headers} if result.headers else {}
                headers["X-Request-Id"] = record.request_id
                result = replace(result, headers=headers)
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
                self._end_span(record, outcome)

    async def passthrough(self, path: str, exchange: Exchange) -> Answer:
        """`/tokenize` and `/detokenize` (vLLM's): sent as they are to one eligible engine of
        the body's model, least busy first, no PD; its answer is the client's."""
        name = path.strip("/")
        start = self._clock.monotonic()
        answer, _ = self.authenticate(exchange.header("authorization"))
        if answer is None:
            answer = await self._pass(path, exchange)
        self._requests(name, answer.outcome).inc()
        self._latency(name).observe(self._clock.monotonic() - start)
        return answer

    async def _pass(self, path: str, exchange: Exchange) -> Answer:
        try:
            raw = await self._read_body(exchange)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
            model = body.get("model", self._cfg.model) if isinstance(body, dict) else None
            if not isinstance(model, str):
                raise BadRequest(400, "request body must be an object with a string 'model'")
            if not self._fleet.knows_model(model):
                raise BadRequest(
                    404, f"The model `{model}` does not exist.", param="model",
                    type_="NotFoundError", code="model_not_found",
                )  # fmt: skip
        except BadRequest as exc:
            return _bad_request(exc)
        now = self._clock.monotonic()
        roles = self._fleet.needed_roles(model)
        candidates = [c for r in roles for c in self._fleet.candidates(r, now, model)]
        engine_id = least_in_flight(candidates, 0)
        if engine_id is None:
            return error_answer(
                503, f"no capacity: {model}", "service_unavailable", "no_capacity", retry_after_s=1
            )
        engine = self._fleet.get(engine_id).config
        headers = engine_headers(self._key(engine), self._new_id())
        try:
            reply = await self._client.post(
                PoolKind.DATA, engine.url + path, raw, headers, self._serving.first_token_timeout_s
            )
        except EngineFailure as exc:
            return error_answer(502, f"upstream failure: {exc}", "upstream_error", "upstream_error")
        outcome = (
            "ok"
            if reply.status < 400
            else "client_error"
            if reply.status < 500
            else "upstream_error"
        )
        return Answer(reply.status, reply.body, reply.content_type, outcome)

    def _end_span(self, record: RequestRecord, outcome: str) -> None:
        assert self._tracer is not None
        attributes = {
            "http.response.status_code": record.status,
            "narwhal.outcome": outcome,
            "narwhal.model": record.model or "",
            "narwhal.attempts": record.attempts,
            "narwhal.migrations": record.migrations,
        }
        self._tracer.end(record.span, attributes, ok=outcome == "ok")

    def _traced(
        self, exchange: Exchange, attempt: _Attempt, leg: str, engine_id: str
    ) -> AbstractContextManager[None]:
        """A leg's span when tracing is on (the engine's `traceparent` names it); otherwise
        one shared no-op, so an untraced leg pays one attribute test."""
        record = exchange.record
        if record is None or record.span is None:
            return _UNTRACED
        return self._leg_span(record, attempt, leg, engine_id)

    @contextmanager
    def _leg_span(
        self, record: RequestRecord, attempt: _Attempt, leg: str, engine_id: str
    ) -> Iterator[None]:
        assert self._tracer is not None
        attributes = {"narwhal.engine": engine_id, "narwhal.attempt_id": attempt.request_id}
        span = self._tracer.leg(record.span, leg, attributes)
        attempt.trace = self._tracer.headers(span)
        ok = False
        try:
            yield
            ok = True
        finally:
            self._tracer.end(span, {}, ok)

    async def close(self) -> None:
        """Send the spans still batched (tracing on)."""
        if self._tracer is not None:
            await asyncio.to_thread(self._tracer.shutdown)

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
            raw = await self._read_body(exchange)
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
            return _bad_request(exc)
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
        bounded = self._serving.policy == "bounded"
        try:
            if bounded:
                await self.pool.acquire(
                    deadline - self._clock.monotonic(), self._serving.queue_limit
                )
            elif not self.pool.try_acquire():
                raise PoolExhausted("data pool exhausted")
        except PoolExhausted:
            return error_answer(
                503,
                "server saturated: no data connection available",
                "service_unavailable",
                "saturated",
                retry_after_s=1,
            )
        try:
            if isinstance(req, EmbeddingsRequest):
                return await self._embed(req, exchange, deadline)
            if req.n > 1 or req.batch is not None:
                return await self._fan_out(req, exchange, deadline)
            return await self._serve(req, exchange, deadline)
        finally:
            self.pool.release()

    async def _read_body(self, exchange: Exchange) -> bytes:
        """The whole body, which may arrive in many chunks, up to `max_body_bytes`."""
        limit = self._serving.max_body_bytes
        length = exchange.content_length
        if length is not None and length > limit:
            raise BadRequest(413, f"request body exceeds {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while chunk := await exchange.read_some():
            size += len(chunk)
            if size > limit:
                raise BadRequest(413, f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # ---------------------------------------------------------------- policy
    async def _serve(self, req: ClientRequest, exchange: Exchange, deadline: float) -> Result:
        attempts = self._serving.max_attempts if self._serving.policy == "bounded" else 1
        tried: set[str] = set()
        last: Exception | None = None
        may_migrate = (
            self._migration_limit > 0 and req.stream and migratable(req.endpoint, req.body)
        )
        client_req = req
        record = exchange.record
        assert record is not None  # `handle` made it
        for number in range(attempts):
            if number and self._clock.monotonic() >= deadline:
                break
            splice = None
            if may_migrate:  # each attempt from scratch: nothing reached the client yet
                splice = Splice(
                    client_req.endpoint, client_req.body, client_req.include_usage, self._ids_by
                )
                req = replace(client_req, body=splice.first_body())
            attempt = _Attempt(record.next_attempt_id(), record.trace, splice=splice)
            try:
                if number == 0:
                    await self._check_tokens(req, deadline, attempt)
                return await self._attempt(req, exchange, deadline, attempt, tried)
            except Interrupted as exc:
                assert splice is not None
                return await self._migrate(exchange, deadline, splice, exc, tried)
            except BadRequest as exc:
                return _bad_request(exc)
            except (ClientError, NoCapacity, DeadlineExceeded) as exc:
                return _settled(exc)
            except (EngineFailure, Saturated, Moved) as exc:
                last = exc
                if attempt.started:
                    break
                if number + 1 < attempts:
                    self._metrics.retries.labels(_reason(exc)).inc()
        return _failure_response(last)

    async def _fan_out(self, req: ClientRequest, exchange: Exchange, deadline: float) -> Answer:
        """Batched prompts and `n > 1`: each choice is a request of its own, served by the
        policy as any request is, and the answers merged in order (dataplane/fanout.py). A
        part in flight holds a data connection: the request's own, plus up to
        `fanout.PARALLEL - 1` more that are free now (none: the parts take turns on one). The
        first part that fails (in order) is the answer and the rest are cancelled: the client
        asked for all of them."""
        parts = split(req)
        answers: list[bytes] = [b""] * len(parts)
        failures: list[tuple[int, Answer]] = []
        extra = 0
        while extra < min(PARALLEL, len(parts)) - 1 and self.pool.try_acquire():
            extra += 1
        turns = asyncio.Semaphore(1 + extra)

        async def serve(index: int, part: ClientRequest) -> None:
            async with turns:
                result = await self._serve(part, exchange, deadline)
            assert isinstance(result, Answer)  # parts are never streamed
            if result.status != 200:
                failures.append((index, result))
                raise _PartFailed()  # cancels the other parts
            answers[index] = result.body

        try:
            async with asyncio.TaskGroup() as group:
                for index, part in enumerate(parts):
                    group.create_task(serve(index, part))
        except* _PartFailed:
            pass  # `failures` says which
        finally:
            for _ in range(extra):
                self.pool.release()
        if failures:
            return min(failures, key=lambda f: f[0])[1]
        return Answer(200, merge(answers, req.n), "application/json")

    async def _embed(self, req: EmbeddingsRequest, exchange: Exchange, deadline: float) -> Answer:
        """`/v1/embeddings`: the client's body, as it is, to an embed engine of its model, no
        PD. Its outcome is evidence like any leg's; under `bounded` a failed attempt is
        retried on another engine (an embedding has no side effects)."""
        if self._fleet.needed_roles(req.model) != (Role.EMBED,):
            message = f"The model `{req.model}` does not serve embeddings"
            refused = BadRequest(400, message, param="model", code="model_not_supported")
            return _bad_request(refused)
        attempts = self._serving.max_attempts if self._serving.policy == "bounded" else 1
        record = exchange.record
        assert record is not None  # `handle` made it
        tried: set[str] = set()
        last: Exception | None = None
        for number in range(attempts):
            if number and self._clock.monotonic() >= deadline:
                break
            attempt = _Attempt(record.next_attempt_id(), record.trace)
            try:
                with (
                    self._placed(Role.EMBED, tried, req.model) as engine,
                    self._traced(exchange, attempt, "embed", engine.id),
                ):
                    self._placed_on(exchange, None, engine.id)
                    return await self._embed_leg(req, deadline, attempt, engine)
            except (ClientError, NoCapacity, DeadlineExceeded) as exc:
                return _settled(exc)
            except (EngineFailure, Saturated) as exc:
                last = exc
                if number + 1 < attempts:
                    self._metrics.retries.labels(_reason(exc)).inc()
        return _failure_response(last)

    async def _embed_leg(
        self, req: EmbeddingsRequest, deadline: float, attempt: _Attempt, engine: EngineState
    ) -> Answer:
        """One embed engine's answer. The engine has `first_token_timeout_s` to answer whole
        (an embedding is one forward pass, like a first token); when the request's own
        deadline is nearer, running out is the request's, not the engine's."""
        remaining = deadline - self._clock.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded()
        timeout_s = min(self._serving.first_token_timeout_s, remaining)
        config = engine.config
        headers = engine_headers(self._key(config), attempt.request_id, attempt.trace)
        try:
            reply = await self._client.post(
                PoolKind.DATA, config.url + "/v1/embeddings", req.raw, headers, timeout_s
            )
        except EngineFailure as exc:
            if exc.failure_class is FailureClass.TIMEOUT and timeout_s < (
                self._serving.first_token_timeout_s
            ):
                raise DeadlineExceeded() from None
            raise self._fail(engine, "embed", exc) from None
        if reply.status != 200:
            raise self._status_failure(
                engine, "embed", reply.status, reply.body, reply.content_type
            )
        self._succeed(engine, "embed", SuccessKind.EMBEDDED)
        return Answer(200, reply.body, reply.content_type or "application/json", "ok")

    async def _migrate(
        self,
        exchange: Exchange,
        deadline: float,
        splice: Splice,
        interrupted: Interrupted,
        tried: set[str],
    ) -> Result:
        """The client's stream began and its leg failed: continue the generation on fresh
        pairs, up to `serving.migration_limit` times within the request's deadline; when no
        pair can, end the stream with the error event (DESIGN §1, "Migration")."""
        failure: Exception = interrupted.failure
        cause = interrupted.cause
        left = interrupted.engine_id  # the engine whose stream this request last lost
        record = exchange.record
        assert record is not None
        rendered: str | None = None
        while splice.migrations < self._migration_limit and self._clock.monotonic() < deadline:
            if splice.needs_rendered_prompt and rendered is None:
                try:
                    rendered = await self._rendered_chat(splice, deadline)
                except (EngineFailure, NoCapacity) as exc:
                    failure, cause = exc, _reason(exc)
                    splice.migrations += 1
                    continue
            leg = splice.continuation(rendered)
            if leg is None:
                break
            splice.migrations += 1
            self._migrations_by(cause, leg.kind).inc()
            splice.start_leg(leg)
            record.migrations = splice.migrations
            self._note(
                "migration", left,
                f"stream {record.request_id} continued after {splice.delivered} tokens "
                f"({cause}, {leg.kind}, migration {splice.migrations})",
            )  # fmt: skip
            if record.span is not None:
                event = {"narwhal.cause": cause, "narwhal.kind": leg.kind}
                record.span.add_event("migration", event)
            log.info(
                "migrating a stream after %d tokens (%s, %s, migration %d)",
                splice.delivered, cause, leg.kind, splice.migrations,
                extra={"request_id": record.request_id},
            )  # fmt: skip
            attempt = _Attempt(record.next_attempt_id(), record.trace, splice=splice)
            try:
                model = splice.body.get("model", self._cfg.model)
                continued = _continued(leg, model)
                return await self._attempt(continued, exchange, deadline, attempt, tried)
            except Interrupted as exc:
                failure, cause, left = exc.failure, exc.cause, exc.engine_id
                continue
            except (EngineFailure, Saturated, NoCapacity, DeadlineExceeded, Moved) as exc:
                failure, cause = exc, _reason(exc)  # before the continuation's first byte
                continue
            except (BadRequest, ClientError) as exc:
                failure, cause = exc, "refused"
                continue
        until = self._loop_deadline(deadline)
        if splice.finished and not splice.done:
            # Every token was delivered; only the stream's end was lost with the leg.
            self._migrated("saved").inc()
            await self._evidence.settled()
            ok = await _finish(exchange, splice.ending(), until)
            return Streamed("ok" if ok else "deadline")
        self._migrated("lost").inc()
        self._note(
            "migration", left,
            f"stream {record.request_id} lost after {splice.delivered} tokens and "
            f"{splice.migrations} migrations ({cause})",
        )  # fmt: skip
        return await self._error_event(exchange, failure, until)

    async def _rendered_chat(self, splice: Splice, deadline: float) -> str | None:
        """The chat's prompt as an eligible engine's template renders it (llama.cpp gives
        no prompt ids in the stream)."""
        now = self._clock.monotonic()
        model = splice.body.get("model", self._cfg.model)
        role = self._fleet.needed_roles(model)[0]
        engine_id = least_in_flight(self._fleet.candidates(role, now, model), 0)
        if engine_id is None:
            raise NoCapacity(role)
        engine = self._fleet.get(engine_id).config
        headers = engine_headers(self._key(engine), self._new_id())
        timeout_s = max(0.0, min(self._serving.first_token_timeout_s, deadline - now))
        return await self._adapters(engine).rendered_chat(
            PoolKind.DATA, engine, splice.body, headers, timeout_s
        )

    def _loop_deadline(self, deadline: float) -> float:
        """`deadline` (our clock) on the loop's clock, which asyncio's timeouts use."""
        return deadline + asyncio.get_running_loop().time() - self._clock.monotonic()

    async def _check_tokens(self, req: ClientRequest, deadline: float, attempt: _Attempt) -> None:
        limits = [
            e.max_model_len
            for e in self._fleet
            if e.max_model_len is not None and e.serves_model(req.model)
        ]  # the model's engines' (another model's context is not this one's)

        async def count(r: ClientRequest) -> int | None:
            role = self._fleet.needed_roles(r.model)[0]
            now = self._clock.monotonic()
            engine_id = least_in_flight(self._fleet.candidates(role, now, r.model), 0)
            if engine_id is None:
                return None
            body: dict[str, Any] = {"model": r.model or self._cfg.model}
            if r.endpoint == "chat":
                body["messages"] = r.body["messages"]
            else:
                body["prompt"] = r.body["prompt"]
            engine = self._fleet.get(engine_id)
            try:
                reply = await self._client.post(
                    PoolKind.DATA,
                    engine.config.url + "/tokenize",
                    orjson.dumps(body),
                    engine_headers(self._key(engine.config), attempt.request_id, attempt.trace),
                    max(
                        0.0,
                        min(
                            self._serving.first_token_timeout_s, deadline - self._clock.monotonic()
                        ),
                    ),
                )
                if reply.status != 200:
                    return None
                value = orjson.loads(reply.body).get("count")
                return value if isinstance(value, int) else None
            except (EngineFailure, orjson.JSONDecodeError, AttributeError):
                return None

        result = await self._tokens.check(req, min(limits) if limits else None, count)
        self._token_checks(result.verdict.value).inc()

    @staticmethod
    def _placed_on(exchange: Exchange, prefill: str | None, decode: str | None) -> None:
        """The engines of the request's latest attempt, for its access-log line."""
        record = exchange.record
        if record is not None:
            record.prefill, record.decode = prefill, decode

    # ---------------------------------------------------------------- one attempt
    @contextmanager
    def _placed(self, role: Role, tried: set[str], model: str | None) -> Iterator[EngineState]:
        """An engine for `role`, in flight there until the block ends. Engines not yet
        `tried` by this request come first; the pick and its count are one step for every
        worker (`InFlightCounts.claim`)."""
        now = self._clock.monotonic()

        def choose(turn: int) -> str | None:
            candidates = self._fleet.candidates(role, now, model)
            return least_in_flight(candidates, turn, exclude=tried) or least_in_flight(
                candidates, turn
            )

        counts = self._in_flight_counts
        engine_id = counts.claim(role.value, choose)
        if engine_id is None:
            raise NoCapacity(role, not self._fleet.has_verified(role, model))
        tried.add(engine_id)
        try:
            yield self._fleet.get(engine_id)
        finally:
            counts.leave(engine_id)

    def _fail(self, engine: EngineState, leg: str, failure: EngineFailure) -> EngineFailure:
        self._leg_outcomes(engine.id, leg, failure.failure_class.value).inc()
        self._evidence.failure(engine.id, failure, leg)
        return failure

    def _malformed(self, engine: EngineState, leg: str) -> EngineFailure:
        return self._fail(engine, leg, EngineFailure(FailureClass.STREAM, "malformed SSE event"))

    def _succeed(self, engine: EngineState, leg: str, kind: SuccessKind) -> None:
        self._leg_outcomes(engine.id, leg, kind.value).inc()
        self._evidence.success(engine.id, kind, leg)

    def _status_failure(
        self, engine: EngineState, leg: str, status: int, body: bytes, content_type: str
    ) -> Exception:
        failure_class = classify_status(status, body)
        if failure_class is None:
            self._succeed(engine, leg, SuccessKind.CLIENT_4XX)
            if status >= 500:  # a vLLM-style 500 for a prompt too long: the client's 400
                return ClientError(400, _client_error_body(body), "application/json")
            return ClientError(status, body, content_type)
        failure = self._fail(
            engine, leg, EngineFailure(failure_class, f"HTTP {status}", status=status)
        )
        if failure_class is FailureClass.OVERLOAD:
            return Saturated(f"engine {engine.id} answered {status}")
        return failure

    async def _attempt(
        self,
        req: ClientRequest,
        exchange: Exchange,
        deadline: float,
        attempt: _Attempt,
        tried: set[str],
    ) -> Result:
        model = req.model
        roles = self._fleet.needed_roles(model)
        if roles == (Role.EMBED,):
            raise BadRequest(
                400, f"The model `{model}` serves embeddings only (/v1/embeddings)",
                param="model", code="model_not_supported",
            )  # fmt: skip
        if roles == (Role.BOTH,):
            with (
                self._placed(Role.BOTH, tried, model) as engine,
                self._traced(exchange, attempt, "unified", engine.id),
            ):
                self._placed_on(exchange, None, engine.id)
                body = self._adapters(engine.config).unified_body(req.body)
                headers = engine_headers(
                    self._key(engine.config), attempt.request_id, attempt.trace
                )
                return await self._final_leg(
                    req, exchange, deadline, attempt, engine, body, headers, "unified"
                )
        now = self._clock.monotonic()
        # Never spend a prefill whose KV nobody can read; /ready's precedence (readiness.py):
        # a role not yet verified (starting) before a role without capacity.
        missing = [
            r for r in (Role.PREFILL, Role.DECODE) if not self._fleet.candidates(r, now, model)
        ]
        if missing:
            starting = [r for r in missing if not self._fleet.has_verified(r, model)]
            raise NoCapacity(starting[0], True) if starting else NoCapacity(missing[0])
        with (
            self._placed(Role.PREFILL, tried, model) as prefill,
            self._traced(exchange, attempt, "prefill", prefill.id),
        ):
            self._placed_on(exchange, prefill.id, None)
            handoff = await self._prefill_leg(req, deadline, attempt, prefill)
        if isinstance(handoff, Answer):
            return await self._finished_in_prefill(exchange, deadline, attempt, handoff)
        try:
            with (
                self._placed(Role.DECODE, tried, model) as decode,
                self._traced(exchange, attempt, "decode", decode.id),
            ):
                self._placed_on(exchange, prefill.id, decode.id)
                return await self._decode_leg(
                    req, exchange, deadline, attempt, prefill, decode, handoff
                )
        finally:
            # Where only the decode can judge the handoff, the prefill's success (which clears
            # kv_handoff evidence) counts once the decode did not refuse it or recompute the
            # prompt; recorded first, it would reset every kv_handoff streak and the streak
            # would never reach eject_after. A decode failing for another reason leaves the
            # prefill's success standing.
            adapter = self._adapters(prefill.config)
            if adapter.decode_verifies_handoff and not attempt.handoff_failed:
                self._succeed(prefill, "prefill", SuccessKind.PREFILL_HANDOFF)
            await adapter.discard(prefill.config, handoff)

    async def _finished_in_prefill(
        self, exchange: Exchange, deadline: float, attempt: _Attempt, answer: Answer
    ) -> Result:
        """The prefill's one token completed the request. A stream that may migrate has its
        events rewritten like a decode's; one that already began gets them through the
        exchange."""
        splice = attempt.splice
        if splice is None:
            return answer
        body = splice.relay(answer.body)
        if not splice.opened:
            return replace(answer, body=body)
        self._migrated("saved").inc()
        try:
            await exchange.send(body)
        except _CLIENT_GONE:
            return Streamed("client_disconnect")
        ok = await _finish(exchange, b"", self._loop_deadline(deadline))
        return Streamed("ok" if ok else "deadline")

    async def _prefill_leg(
        self, req: ClientRequest, deadline: float, attempt: _Attempt, engine: EngineState
    ) -> object:
        """The extracted handoff, or the whole answer when the prefill finished the request."""
        remaining = deadline - self._clock.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded()
        limit = min(self._serving.first_token_timeout_s, remaining)
        self._stats.request(engine.id)
        leg_start = time.perf_counter()
        try:
            reply = await self._adapters(engine.config).prefill(
                PoolKind.DATA,
                engine.config,
                req.endpoint,
                req.body,
                engine_headers(self._key(engine.config), attempt.request_id, attempt.trace),
                limit,
            )
        except EngineFailure as exc:
            raise self._fail(engine, "prefill", exc) from None
        except SlotsBusy as exc:
            raise Saturated(str(exc)) from None
        if reply.status != 200:
            raise self._status_failure(
                engine, "prefill", reply.status, reply.body, reply.content_type
            )
        result = reply.result
        if isinstance(result, Unreadable):
            raise self._fail(
                engine, "prefill", EngineFailure(FailureClass.KV_HANDOFF, result.reason)
            )
        if isinstance(result, FinishedInPrefill):
            self._succeed(engine, "prefill", SuccessKind.PREFILL_FINISHED)
            assert isinstance(reply.parsed, dict)
            return _finished_response(req, reply.parsed)
        self._stats.latency(engine.id, time.perf_counter() - leg_start)
        if not self._adapters(engine.config).decode_verifies_handoff:
            # Recorded now: deferred to the end of a long stream, it would erase failures
            # the prefill had since (otherwise see _attempt).
            self._succeed(engine, "prefill", SuccessKind.PREFILL_HANDOFF)
        return result

    async def _decode_leg(
        self,
        req: ClientRequest,
        exchange: Exchange,
        deadline: float,
        attempt: _Attempt,
        prefill: EngineState,
        engine: EngineState,
        handoff: object,
    ) -> Result:
        """Let the decode engine take the handoff, then run the final leg on it."""
        remaining = deadline - self._clock.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded()
        adapter = self._adapters(engine.config)
        headers = engine_headers(self._key(engine.config), attempt.request_id, attempt.trace)
        limit = min(self._serving.first_token_timeout_s, remaining)
        async with AsyncExitStack() as stack:
            try:
                body = await stack.enter_async_context(
                    adapter.decode(PoolKind.DATA, engine.config, req.body, handoff, headers, limit)
                )
            except HandoffRefused as exc:
                attempt.handoff_failed = True
                failure = EngineFailure(FailureClass.KV_HANDOFF, str(exc))
                raise self._fail(prefill, "prefill", failure) from None
            except EngineFailure as exc:
                raise self._fail(engine, "decode", exc) from None
            except SlotsBusy as exc:
                raise Saturated(str(exc)) from None
            return await self._final_leg(
                req, exchange, deadline, attempt, engine, body, headers, "decode", producer=prefill
            )

    async def _final_leg(
        self,
        req: ClientRequest,
        exchange: Exchange,
        deadline: float,
        attempt: _Attempt,
        engine: EngineState,
        body: dict[str, Any],
        headers: dict[str, Any],
        leg: str,
        producer: EngineState | None = None,
    ) -> Result:
        """The leg whose answer goes to the client; `producer` made the handoff it used."""
        url = engine.config.url + PATHS[req.endpoint]
        self._stats.request(engine.id)
        if not req.stream:
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded()
            leg_start = time.perf_counter()
            try:
                data = orjson.dumps(body)
                reply = await self._client.post(PoolKind.DATA, url, data, headers, remaining)
            except EngineFailure as exc:
                raise self._fail(engine, leg, exc) from None
            if reply.status != 200:
                raise self._status_failure(
                    engine, leg, reply.status, reply.body, reply.content_type
                )
            # The answer is the leg's first byte, as a stream's first chunk is: the same
            # latency sample (drift compares engines of a role on it).
            self._stats.latency(engine.id, time.perf_counter() - leg_start)
            self._succeed(engine, leg, SuccessKind.DECODE_DONE)
            self._check_recompute(attempt, producer, engine, reply.body)
            return Answer(200, reply.body, reply.content_type)
        return await self._stream(
            exchange, deadline, attempt, engine, url, body, headers, leg, producer
        )

    def _check_recompute(
        self,
        attempt: _Attempt,
        producer: EngineState | None,
        engine: EngineState,
        final: bytes | None,
    ) -> None:
        """A decode that recomputed the prompt answered correctly but hid an unusable
        handoff: record it against the handoff's producer (DESIGN §1)."""
        if producer is None:
            return
        reason = self._adapters(engine.config).recomputed(final)
        if reason is not None:
            attempt.handoff_failed = True
            self._fail(producer, "prefill", EngineFailure(FailureClass.KV_HANDOFF, reason))

    async def _stream(
        self,
        exchange: Exchange,
        deadline: float,
        attempt: _Attempt,
        engine: EngineState,
        url: str,
        body: dict[str, Any],
        headers: dict[str, Any],
        leg: str,
        producer: EngineState | None,
    ) -> Result:
        """Forward an SSE stream as bytes, with first-token, idle and request deadlines; as
        whole events through the attempt's splice when the stream may migrate."""
        splice = attempt.splice
        loop = asyncio.get_running_loop()
        # Deadlines on the loop's clock (what asyncio.timeout uses), derived from ours.
        offset = loop.time() - self._clock.monotonic()
        request_deadline = deadline + offset
        first_deadline = min(loop.time() + self._serving.first_token_timeout_s, request_deadline)
        idle_s = self._serving.stream_idle_timeout_s
        scanner = SseScanner()
        leg_start = last_chunk = time.perf_counter()
        resp: EngineResponse | None = None
        complete = False  # [DONE] arrived and reached the client
        try:
            async with asyncio.timeout_at(None) as timer:
                watch = ReadWatchdog(loop, timer, first_deadline, request_deadline, idle_s)
                if splice is not None:
                    self._movable.setdefault(engine.id, {})[attempt] = timer
                try:
                    watch.reading()
                    # Serialised here and not kept: orjson's output holds a 4 KB buffer,
                    # which would otherwise stay allocated for the whole stream.
                    resp = await self._client.stream(url, orjson.dumps(body), headers)
                    if resp.status != 200:
                        answer = await resp.read()
                        raise self._status_failure(
                            engine, leg, resp.status, answer, resp.content_type
                        )
                    while True:
                        watch.reading()
                        chunk = await resp.readany()
                        watch.writing()
                        if chunk:
                            scanner.feed(chunk)
                        else:
                            # A final `data: [DONE]` line without its blank line is done:
                            # the client gets the bytes that complete the event.
                            chunk = scanner.end()
                            if not chunk:
                                break
                        if splice is not None:
                            # Whole events, rewritten, up to a malformed one: the client has
                            # every good token before it (then the stream goes on elsewhere).
                            chunk = splice.relay(chunk)
                        elif scanner.malformed:
                            raise self._malformed(engine, leg)
                        now = time.perf_counter()
                        if chunk:
                            try:
                                if not attempt.started:
                                    attempt.started = True
                                    watch.started()
                                    self._stats.latency(engine.id, now - leg_start)
                                    await self._open_stream(exchange, deadline, splice, now)
                                else:
                                    self._metrics.inter_token.observe(now - last_chunk)
                                    self._stats.inter_token(engine.id, now - last_chunk)
                                await exchange.send(chunk)
                            except _CLIENT_GONE:
                                raise ClientGone() from None
                            last_chunk = now
                            if splice is not None:
                                splice.last_sent_s = now
                        if splice is not None and (scanner.malformed or splice.broken):
                            raise self._malformed(engine, leg)
                        if scanner.done:
                            complete = splice is None or splice.done
                            break  # the answer is complete, whether or not the engine hangs up
                except OSError as exc:
                    raise self._fail(
                        engine, leg, classify_exception(exc, FailureClass.STREAM)
                    ) from None
                finally:
                    watch.close()
                    if splice is not None:
                        self._unmovable(engine.id, attempt)
        except TimeoutError:
            if attempt.moved:
                return await self._moved(attempt, engine.id)
            if watch.writing_expired:
                # The client stopped reading and let the request's deadline pass: not an
                # engine's fault. Cut it off so its data connection and the engine's slot free.
                exchange.cut_off()
                return Streamed("deadline")
            if loop.time() >= request_deadline - 1e-3 and attempt.started:
                failure: Exception = DeadlineExceeded()
            else:
                which = "first-token deadline" if not attempt.started else "mid-stream silence"
                failure = self._fail(
                    engine, leg, EngineFailure(FailureClass.STREAM, which, timed_out=True)
                )
            return await self._end_stream(exchange, attempt, engine.id, failure, request_deadline)
        except EngineFailure as exc:
            return await self._end_stream(exchange, attempt, engine.id, exc, request_deadline)
        except ClientGone:
            return Streamed("client_disconnect")
        finally:
            if resp is not None and not complete:
                resp.close()  # the engine sees the disconnect and aborts
        if not scanner.done:
            failure = self._fail(
                engine, leg, EngineFailure(FailureClass.STREAM, "stream ended without [DONE]")
            )
            return await self._end_stream(exchange, attempt, engine.id, failure, request_deadline)
        assert resp is not None
        outcome = "ok"
        if scanner.error is not None:
            # The engine reported an error in band (then [DONE]): the client has it as sent,
            # or, when the stream may migrate, it is continued elsewhere; the engine is
            # charged as for an error status.
            detail = scanner.error[:200].decode(errors="replace")
            failure = self._fail(engine, leg, EngineFailure(FailureClass.INFERENCE_STATUS, detail))
            if splice is not None:
                return await self._end_stream(
                    exchange, attempt, engine.id, failure, request_deadline
                )
            outcome = "upstream_error_midstream"
        else:
            self._succeed(engine, leg, SuccessKind.DECODE_DONE)
            self._check_recompute(attempt, producer, engine, scanner.last)
            if exchange.record is not None and (splice is None or not splice.migrations):
                exchange.record.usage_source = scanner.last  # a continuation's counts its leg
            if splice is not None and splice.migrations:
                self._migrated("saved").inc()
        exchange.settled_outcome = outcome
        await self._evidence.settled()
        try:
            if not await _finish(exchange, b"", request_deadline):
                outcome = "deadline"
        except BaseException:
            resp.close()
            raise
        await _release_at_eof(resp)
        return Streamed(outcome)

    def _unmovable(self, engine_id: str, attempt: _Attempt) -> None:
        streams = self._movable[engine_id]
        del streams[attempt]
        if not streams:
            del self._movable[engine_id]

    async def _moved(self, attempt: _Attempt, engine_id: str) -> Result:
        """The operator moved this stream off its engine: retried elsewhere before its first
        byte, continued elsewhere after it (`Interrupted`, with nothing charged)."""
        if not attempt.started:
            raise Moved()
        splice = attempt.splice
        assert splice is not None
        splice.interrupted_s = splice.last_sent_s
        failure = EngineFailure(FailureClass.STREAM, "moved off for planned maintenance")
        raise Interrupted(failure, "maintenance", engine_id)

    async def _open_stream(
        self, exchange: Exchange, deadline: float, splice: Splice | None, now: float
    ) -> None:
        """An attempt's first bytes for the client: the stream's head and its time to first
        token, or, for a migrated stream, the gap the client saw."""
        if splice is not None and splice.opened:
            if splice.interrupted_s is not None:
                self._metrics.migration_gap.observe(now - splice.interrupted_s)
                splice.interrupted_s = None
            return
        record = exchange.record
        await exchange.start_stream({"X-Request-Id": record.request_id} if record else {})
        if splice is not None:
            splice.opened = True
        arrived = deadline - self._serving.request_timeout_s
        ttft = self._clock.monotonic() - arrived
        self._metrics.ttft.observe(ttft)
        if record is not None:
            record.ttft_s = ttft

    async def _end_stream(
        self,
        exchange: Exchange,
        attempt: _Attempt,
        engine_id: str,
        failure: Exception,
        until: float,
    ) -> Result:
        """Before the attempt's first byte, let the policy answer; after it, continue the
        stream elsewhere when it may migrate (`Interrupted`), else end it with an error
        event."""
        if not attempt.started:
            raise failure
        splice = attempt.splice
        if splice is not None and isinstance(failure, EngineFailure):
            await self._evidence.settled()  # placement sees the failed engine paused
            splice.interrupted_s = splice.last_sent_s
            raise Interrupted(failure, _cause(failure), engine_id)
        return await self._error_event(exchange, failure, until)

    async def _error_event(self, exchange: Exchange, failure: Exception, until: float) -> Result:
        status, message = _status_for(failure)
        if exchange.record is not None:
            message = f"{message} (request {exchange.record.request_id})"
        await self._evidence.settled()
        await _finish(exchange, sse_error_event(message, "upstream_error", status), until)
        return Streamed("upstream_error_midstream")


async def _finish(exchange: Exchange, last: bytes, until: float) -> bool:
    """Write `last` and end the client's response by `until` (loop time); False when the client
    did not take them in time and was cut off. A client that already left is not waited for."""
    try:
        async with asyncio.timeout_at(until):
            if last:
                await exchange.send(last)
            await exchange.end()
    except _CLIENT_GONE:
        pass
    except TimeoutError:
        exchange.cut_off()
        return False
    return True


def _client_error_body(engine_body: bytes) -> bytes:
    """An engine's error, in the OpenAI error shape as a 400 (`{"error": {...}}` or vLLM's
    flat `{"object": "error", "message": ...}`; any other body's text as the message)."""
    try:
        parsed = orjson.loads(engine_body)
        inner = parsed.get("error", parsed) if isinstance(parsed, dict) else None
        message = inner.get("message") if isinstance(inner, dict) else None
    except orjson.JSONDecodeError:
        message = None
    if not isinstance(message, str):
        message = engine_body[:1024].decode(errors="replace")
    return error_body(message, "BadRequestError", 400, param="prompt")


async def _release_at_eof(resp: EngineResponse) -> None:
    """After `[DONE]`: give the engine connection back for reuse once the body's end arrives,
    which usually follows at once; an engine that holds the stream open is hung up on."""
    try:
        if not resp.at_eof():
            async with asyncio.timeout(_EOF_AFTER_DONE_S):
                while await resp.readany():
                    pass  # nothing after [DONE] is part of the answer
    except (TimeoutError, OSError):
        pass
    finally:
        resp.release()  # closes the socket when the body's end never came


def _reason(exc: Exception) -> str:
    if isinstance(exc, EngineFailure):
        return exc.failure_class.value
    if isinstance(exc, NoCapacity):
        return "no_capacity"
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, Moved):
        return "maintenance"
    return "saturated"


def _cause(failure: EngineFailure) -> str:
    """Why a stream was migrated: `connection_lost`, `stream_idle` (mid-stream silence),
    `error_event` (in band), `invalid_termination` (no `[DONE]`, a malformed event)."""
    cls = failure.failure_class
    if cls is FailureClass.STREAM:
        return "stream_idle" if failure.timed_out else "invalid_termination"
    if cls is FailureClass.INFERENCE_STATUS:
        return "error_event"
    if cls is FailureClass.CONNECTION:
        return "connection_lost"
    return cls.value


def _continued(leg: Continuation, model: str) -> ClientRequest:
    """A continuation as the request its legs serve (always a stream, of the same model)."""
    options = leg.body.get("stream_options")
    return ClientRequest(
        endpoint=leg.endpoint,
        body=leg.body,
        stream=True,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        max_tokens=leg.body.get("max_tokens"),
        prompt_text=None,
        prompt_token_count=None,
        message_count=0,
        model=model,
    )


def _status_for(exc: Exception | None) -> tuple[int, str]:
    if isinstance(exc, DeadlineExceeded):
        return 504, "request deadline exceeded"
    if isinstance(exc, EngineFailure):
        if exc.failure_class is FailureClass.TIMEOUT or exc.timed_out:
            return 504, f"upstream timeout: {exc.detail}"
        return 502, f"upstream failure ({exc.failure_class.value}): {exc.detail}"
    return 502, "upstream failure"


def _settled(exc: ClientError | NoCapacity | DeadlineExceeded) -> Answer:
    """An attempt's outcome that ends the request whatever the policy: the engine's 4xx, no
    capacity (503), or the request's own deadline (504)."""
    if isinstance(exc, ClientError):
        return Answer(exc.status, exc.body, exc.content_type or "application/json", "client_error")
    if isinstance(exc, NoCapacity):
        return error_answer(503, str(exc), "service_unavailable", "no_capacity", retry_after_s=1)
    return error_answer(504, "request deadline exceeded", "timeout", "deadline")


def _failure_response(exc: Exception | None) -> Answer:
    if isinstance(exc, Moved):  # every attempt was moved off by planned maintenance
        return error_answer(
            503,
            "engines went into planned maintenance during the request",
            "service_unavailable",
            "no_capacity",
            retry_after_s=1,
        )
    if isinstance(exc, Saturated):
        return error_answer(
            503, f"server saturated: {exc}", "service_unavailable", "saturated", retry_after_s=1
        )
    status, message = _status_for(exc)
    outcome = "upstream_timeout" if status == 504 else "upstream_error"
    return error_answer(status, message, "upstream_error", outcome)


def _bad_request(exc: BadRequest) -> Answer:
    return error_answer(
        exc.status, exc.message, exc.type, "bad_request", param=exc.param, code=exc.code
    )


def _finished_response(req: ClientRequest, parsed: dict[str, Any]) -> Answer:
    """The prefill's one token completed the request: answer it, as a stream if asked."""
    parsed.pop("kv_transfer_params", None)
    if not req.stream:
        return Answer(200, orjson.dumps(parsed), "application/json")
    choice = dict(parsed["choices"][0]) if parsed.get("choices") else {"index": 0}
    chunk: dict[str, Any] = {k: parsed.get(k) for k in ("id", "created", "model")}
    if req.endpoint == "chat":
        message = choice.pop("message", None)
        message = message if isinstance(message, dict) else {}
        chunk["object"] = "chat.completion.chunk"
        choice["delta"] = {"role": "assistant", "content": message.get("content") or ""}
    else:
        chunk["object"] = "text_completion"
    chunk["choices"] = [choice]
    events = [b"data: " + orjson.dumps(chunk) + b"\n\n"]
    if req.include_usage and parsed.get("usage") is not None:
        usage = {**chunk, "choices": [], "usage": parsed["usage"]}
        events.append(b"data: " + orjson.dumps(usage) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return Answer(200, b"".join(events), "text/event-stream")
