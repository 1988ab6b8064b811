"""The request path's entry: authentication, the body, admission, then the serving policy
over attempts (`policy.py`), each attempt placing a prefill and a decode (or one unified or
embed leg) and running them (`legs.py`, `stream_leg.py`); a broken stream is continued
elsewhere (`migration.py`). Batched prompts and `n > 1` fan out (`fanout.py`).

A proxied stream owns its accounting: in-flight counts and evidence are recorded exactly once
whether the stream ends, fails, or the client leaves (a client that leaves records nothing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Literal, Protocol

import orjson

from narwhal.clock import Clock
from narwhal.config import Config, EngineConfig, Role
from narwhal.dataplane.access_log import AccessLog
from narwhal.dataplane.auth import ApiKeys, KeysUnreadable, load_keys
from narwhal.dataplane.errors import error_answer, error_body
from narwhal.dataplane.exchange import Answer, Exchange, Result, Streamed
from narwhal.dataplane.fanout import PARALLEL, merge, split
from narwhal.dataplane.leg import Attempt, Leg
from narwhal.dataplane.legs import Legs
from narwhal.dataplane.migration import Continuation, Splice, migratable
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
from narwhal.dataplane.placement import least_in_flight
from narwhal.dataplane.policy import Limits, Next, Outcome, after_attempt, limits_for, may_continue
from narwhal.dataplane.pool import Pool, PoolExhausted
from narwhal.dataplane.prefix import PrefixPlacement, Prompt
from narwhal.dataplane.record import TRACE_HEADERS, RequestRecord, client_request_id
from narwhal.dataplane.requests import (
    BadRequest,
    ClientRequest,
    EmbeddingsRequest,
    parse_embeddings,
    parse_request,
)
from narwhal.dataplane.stream_leg import CLIENT_GONE, Streams, finish
from narwhal.dataplane.tokens import TokenBudget
from narwhal.engine.adapter import PATHS, Endpoint
from narwhal.engine.failures import ClientError, EngineFailure, SuccessKind
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient, PoolKind, engine_headers
from narwhal.fleet.evidence_sink import EvidenceSink
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.telemetry.events import Note
from narwhal.telemetry.metrics import Children, DataMetrics
from narwhal.telemetry.timeline import Timeline
from narwhal.telemetry.tracing import make_tracer

log = logging.getLogger("narwhal.proxy")

_UNTRACED = nullcontext()  # an untraced leg's span


def _unnoted(kind: str, engine_id: str | None, what: str) -> None:
    """No timeline (a data plane built on its own, as in unit tests)."""


Route = Endpoint | Literal["embeddings"]
"""What `handle` serves: a PD generation, or embeddings (passed to an embed engine)."""


class Gate(Protocol):
    """Whether new requests are admitted: `Admission` in one process, a worker's snapshot of
    it (with its own expiry) in each worker."""

    def closed_reason(self) -> str | None: ...


class _PartFailed(Exception):
    """A part of a fanned-out request was not answered 200 (its answer is the request's)."""


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
        prefix: PrefixPlacement | None = None,
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
        self._migrations_by = Children(metrics.migrations)
        self._migrated = Children(metrics.migrated_streams)
        self._moves = Moves()
        self._legs = Legs(client, adapters, evidence, metrics, self._stats, config.serving)
        self._streams = Streams(self._legs, self._moves, clock)
        self._prefix = prefix or PrefixPlacement(config, clock)
        self._prefix_lookups = Children(metrics.prefix_lookup_tokens)
        self._prefix_hits = Children(metrics.prefix_hit_tokens)
        self._keys = ApiKeys(load_keys(config.auth)) if config.auth.enabled else None
        self._by_key = Children(metrics.key_requests)
        self._ids_by = adapters.of_api(config.fleet_api).token_ids_by  # one API per fleet
        self._tracer = make_tracer(config.tracing)  # None: not traced, and nothing paid
        self._apply(config)

    def _apply(self, config: Config) -> None:
        """What a config sets for new requests (at start, and on every reload)."""
        self._cfg = config
        self._serving = self._legs.serving = config.serving
        self._limits: Limits = limits_for(
            config.serving.policy, config.serving.max_attempts, config.serving.migrations
        )
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
        """Migrate every stream decoding on `engine_id` now: the stream goes on elsewhere
        with no evidence against the engine (planned maintenance with `migrate`). Returns how
        many were moved."""
        return self._moves.move(engine_id)

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
            return bad_request(exc)
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
        self, exchange: Exchange, attempt: Attempt, leg: str, engine_id: str
    ) -> AbstractContextManager[None]:
        """A leg's span when tracing is on (the engine's `traceparent` names it); otherwise
        one shared no-op, so an untraced leg pays one attribute test."""
        record = exchange.record
        if record is None or record.span is None:
            return _UNTRACED
        return self._leg_span(record, attempt, leg, engine_id)

    @contextmanager
    def _leg_span(
        self, record: RequestRecord, attempt: Attempt, leg: str, engine_id: str
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
                    await self._check_tokens(req, deadline, attempt)
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
                return await self._migrate(exchange, deadline, splice, interrupted, tried)
            if step is not Next.RETRY:
                return failure_response(last)
            self._metrics.retries.labels(reason(last)).inc()  # type: ignore[arg-type]
            number += 1

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
            return bad_request(refused)
        record = exchange.record
        assert record is not None  # `handle` made it
        tried: set[str] = set()
        number = 0
        while True:
            attempt = Attempt(record.next_attempt_id(), record.trace)
            try:
                with (
                    self._placed(Role.EMBED, tried, req.model) as engine,
                    self._traced(exchange, attempt, "embed", engine.id),
                ):
                    self._placed_on(exchange, None, engine.id)
                    leg = self._leg("embed", engine, attempt, deadline, {})
                    return await self._legs.embed(req, leg, self._clock.monotonic())
            except (ClientError, NoCapacity, DeadlineExceeded) as exc:
                return settled(exc)
            except (EngineFailure, Saturated) as exc:
                last: Exception = exc
            now = self._clock.monotonic()
            if after_attempt(Outcome.RETRYABLE, number, self._limits, now, deadline) is not (
                Next.RETRY
            ):
                return failure_response(last)
            self._metrics.retries.labels(reason(last)).inc()
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
        headers = engine_headers(self._key(engine.config), attempt.request_id, attempt.trace)
        return Leg(name, engine, attempt, deadline, headers, body, producer)

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
        while may_continue(splice.migrations, self._limits, self._clock.monotonic(), deadline):
            if splice.needs_rendered_prompt and rendered is None:
                try:
                    rendered = await self._rendered_chat(splice, deadline)
                except (EngineFailure, NoCapacity) as exc:
                    failure, cause = exc, reason(exc)
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
            attempt = Attempt(record.next_attempt_id(), record.trace, splice=splice)
            try:
                model = splice.body.get("model", self._cfg.model)
                continued = _continued(leg, model)
                return await self._attempt(continued, exchange, deadline, attempt, tried)
            except Interrupted as exc:
                failure, cause, left = exc.failure, exc.cause, exc.engine_id
                continue
            except (EngineFailure, Saturated, NoCapacity, DeadlineExceeded, Moved) as exc:
                failure, cause = exc, reason(exc)  # before the continuation's first byte
                continue
            except (BadRequest, ClientError) as exc:
                failure, cause = exc, "refused"
                continue
        until = self._loop_deadline(deadline)
        if splice.finished and not splice.done:
            # Every token was delivered; only the stream's end was lost with the leg.
            self._migrated("saved").inc()
            await self._evidence.settled()
            ok = await finish(exchange, splice.ending(), until)
            return Streamed("ok" if ok else "deadline")
        self._migrated("lost").inc()
        self._note(
            "migration", left,
            f"stream {record.request_id} lost after {splice.delivered} tokens and "
            f"{splice.migrations} migrations ({cause})",
        )  # fmt: skip
        return await self._streams.error_event(exchange, failure, until)

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

    async def _check_tokens(self, req: ClientRequest, deadline: float, attempt: Attempt) -> None:
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
    def _placed(
        self, role: Role, tried: set[str], model: str | None, prompt: Prompt | None = None
    ) -> Iterator[EngineState]:
        """An engine for `role`, in flight there until the block ends. Engines not yet
        `tried` by this request come first; with a `prompt` (cache-aware placement) the
        engine holding most of its prefix against load, else the least loaded. The pick and
        its count are one step for every worker (`InFlightCounts.claim`)."""
        now = self._clock.monotonic()
        matched = 0

        def choose(turn: int) -> str | None:
            nonlocal matched
            candidates = self._fleet.candidates(role, now, model)
            if prompt is not None:
                ranked = self._prefix.choose(prompt, role, candidates, turn, tried)
                if not ranked:
                    return None
                matched = ranked[0].matched_tokens
                return ranked[0].id
            return least_in_flight(candidates, turn, exclude=tried) or least_in_flight(
                candidates, turn
            )

        counts = self._in_flight_counts
        engine_id = counts.claim(role.value, choose)
        if engine_id is None:
            raise NoCapacity(role, not self._fleet.has_verified(role, model))
        tried.add(engine_id)
        if prompt is not None:
            if role is not Role.DECODE:
                self._prefix_lookups(prompt.model).inc(prompt.tokens)
                self._prefix_hits(prompt.model).inc(matched)
            self._prefix.placed(prompt, engine_id, matched, prefill=role is not Role.DECODE)
        try:
            yield self._fleet.get(engine_id)
        finally:
            counts.leave(engine_id)

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
        prompt = self._prefix.prompt(req, model or self._cfg.model)
        if roles == (Role.BOTH,):
            with (
                self._placed(Role.BOTH, tried, model, prompt) as engine,
                self._traced(exchange, attempt, "unified", engine.id),
            ):
                self._placed_on(exchange, None, engine.id)
                body = self._adapters(engine.config).unified_body(req.body)
                leg = self._leg("unified", engine, attempt, deadline, body)
                return await self._final(req, exchange, leg)
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
            self._placed(Role.PREFILL, tried, model, prompt) as prefill,
            self._traced(exchange, attempt, "prefill", prefill.id),
        ):
            self._placed_on(exchange, prefill.id, None)
            leg = self._leg("prefill", prefill, attempt, deadline, req.body)
            handoff = await self._legs.prefill(req, leg, self._clock.monotonic())
        if isinstance(handoff, Answer):
            return await self._finished_in_prefill(exchange, deadline, attempt, handoff)
        try:
            with (
                self._placed(Role.DECODE, tried, model, prompt) as decode,
                self._traced(exchange, attempt, "decode", decode.id),
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

    async def _finished_in_prefill(
        self, exchange: Exchange, deadline: float, attempt: Attempt, answer: Answer
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
        except CLIENT_GONE:
            return Streamed("client_disconnect")
        ok = await finish(exchange, b"", self._loop_deadline(deadline))
        return Streamed("ok" if ok else "deadline")


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
