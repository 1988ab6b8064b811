"""Migration's I/O (DESIGN §1, "Migration"): a client stream whose leg failed after it began
goes on, from the same token, on a fresh prefill/decode pair, up to `serving.migrations`
times within the request's deadline; when no pair can, the stream ends with an error event.

`migration.Splice` (pure) says what the client has and builds each continuation's request;
this module runs them: each continuation is an attempt of the data plane's (`attempt`, the
same path as the first), and a chat on an engine that gives no prompt ids first has its
prompt rendered by an engine's chat template. It also ends a stream whose prefill's one
token completed it (`finished_in_prefill`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from prometheus_client import Counter

from narwhal.clock import Clock
from narwhal.config import Config
from narwhal.dataplane.engine_calls import KeyOf
from narwhal.dataplane.exchange import Answer, Exchange, Result, Streamed
from narwhal.dataplane.leg import Attempt
from narwhal.dataplane.migration import Continuation, Splice
from narwhal.dataplane.moves import PREEMPTED
from narwhal.dataplane.outcomes import (
    DeadlineExceeded,
    Interrupted,
    Moved,
    NoCapacity,
    NotResumed,
    Saturated,
    reason,
)
from narwhal.dataplane.placement import least_in_flight
from narwhal.dataplane.policy import Limits, may_continue
from narwhal.dataplane.requests import BadRequest, ClientRequest
from narwhal.dataplane.stream_leg import CLIENT_GONE, finish
from narwhal.engine.failures import ClientError, EngineFailure
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import PoolKind, engine_headers
from narwhal.fleet.store import Fleet
from narwhal.telemetry.events import Note
from narwhal.telemetry.metrics import Children

log = logging.getLogger("narwhal.proxy")

Run = Callable[[ClientRequest, Exchange, float, Attempt, set[str]], Awaitable[Result]]
"""One attempt of the data plane's (`DataPlane._attempt`): request, exchange, deadline,
attempt, the engines the request tried."""
ErrorEvent = Callable[[Exchange, Exception, float], Awaitable[Result]]
"""End a begun stream with an error event by a loop-clock time (`Streams.error_event`)."""


class Continuations:
    """`config` is the one in force (replaced on reload): the default model and how long an
    engine has to render a chat's prompt (`serving.first_token_timeout_s`)."""

    def __init__(
        self,
        fleet: Fleet,
        clock: Clock,
        adapters: Adapters,
        key_of: KeyOf,
        new_request_id: Callable[[], str],
        attempt: Run,
        error_event: ErrorEvent,
        settled: Callable[[], Awaitable[None]],
        migrations: Children[Counter],
        migrated: Children[Counter],
        note: Note,
        config: Config,
        resume: Callable[[float], Awaitable[None]],
    ) -> None:
        self._fleet = fleet
        self._clock = clock
        self._adapters = adapters
        self._key_of = key_of
        self._new_id = new_request_id
        self._attempt = attempt
        self._error_event = error_event
        self._settled = settled  # the evidence so far applied
        self._migrations = migrations  # by cause and kind
        self._migrated = migrated  # streams saved or lost
        self._note = note
        self.config = config
        self._resume = resume  # a preempted stream's wait for its turn (flow control)

    async def migrate(
        self,
        exchange: Exchange,
        deadline: float,
        splice: Splice,
        interrupted: Interrupted,
        tried: set[str],
        limits: Limits,
    ) -> Result:
        """`_migrate`; however it ends, the request's record then counts the tokens the
        client's stream used over all its legs (`Splice.usage_event`), not its last leg's."""
        try:
            return await self._migrate(exchange, deadline, splice, interrupted, tried, limits)
        finally:
            if exchange.record is not None:
                exchange.record.usage_source = splice.usage_event()

    async def _migrate(
        self,
        exchange: Exchange,
        deadline: float,
        splice: Splice,
        interrupted: Interrupted,
        tried: set[str],
        limits: Limits,
    ) -> Result:
        """The client's stream began and its leg failed: continue the generation on fresh
        pairs while `policy.may_continue`; when none can, end the stream (with its last
        events if every token was delivered, else with the error event)."""
        failure: Exception = interrupted.failure
        cause = interrupted.cause
        left = interrupted.engine_id  # the engine whose stream this request last lost
        record = exchange.record
        assert record is not None
        rendered: str | None = None
        while may_continue(splice.migrations, limits, self._clock.monotonic(), deadline):
            if cause == PREEMPTED:  # it stepped aside: it goes on when the queue says
                try:
                    await self._resume(deadline)
                except (NotResumed, DeadlineExceeded) as exc:
                    failure, cause = exc, reason(exc)
                    break
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
            self._migrations(cause, leg.kind).inc()
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
                req = continued(leg, splice.body.get("model", self.config.model))
                return await self._attempt(req, exchange, deadline, attempt, tried)
            except Interrupted as exc:
                failure, cause, left = exc.failure, exc.cause, exc.engine_id
                continue
            except (EngineFailure, Saturated, NoCapacity, DeadlineExceeded, Moved) as exc:
                failure, cause = exc, reason(exc)  # before the continuation's first byte
                continue
            except (BadRequest, ClientError) as exc:
                failure, cause = exc, "refused"
                continue
        until = loop_deadline(self._clock, deadline)
        if splice.finished and not splice.done:
            # Every token was delivered; only the stream's end was lost with the leg.
            self._migrated("saved").inc()
            await self._settled()
            ok = await finish(exchange, splice.ending(), until)
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
        model = splice.body.get("model", self.config.model)
        role = self._fleet.needed_roles(model)[0]
        engine_id = least_in_flight(self._fleet.candidates(role, now, model), 0)
        if engine_id is None:
            raise NoCapacity(role)
        engine = self._fleet.get(engine_id).config
        headers = engine_headers(self._key_of(engine), self._new_id())
        timeout_s = max(0.0, min(self.config.serving.first_token_timeout_s, deadline - now))
        return await self._adapters(engine).rendered_chat(
            PoolKind.DATA, engine, splice.body, headers, timeout_s
        )

    async def finished_in_prefill(
        self, exchange: Exchange, deadline: float, attempt: Attempt, answer: Answer
    ) -> Result:
        """The prefill's one token completed the request. A stream that may migrate has its
        events rewritten like a decode's; one that already began (a continuation) gets them
        through the exchange."""
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
        ok = await finish(exchange, b"", loop_deadline(self._clock, deadline))
        return Streamed("ok" if ok else "deadline")


def continued(leg: Continuation, model: str) -> ClientRequest:
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


def loop_deadline(clock: Clock, deadline: float) -> float:
    """`deadline` (on `clock`) on the running loop's clock, which asyncio's timeouts use."""
    return deadline + asyncio.get_running_loop().time() - clock.monotonic()
