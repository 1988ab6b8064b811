"""A streamed final leg: the engine's SSE read and the client's stream written, driven by the
I/O-free `Relay` (what to send, how the stream ends) and bounded by the `ReadWatchdog`
(first-token, idle and request deadlines on one timer).

Before the attempt's first byte a failure goes back to the policy (a retry); after it, a
stream that may migrate is continued elsewhere (`Interrupted`), else ended with an error event.
"""

from __future__ import annotations

import asyncio
import time
from typing import NoReturn

import orjson

from narwhal.clock import Clock
from narwhal.dataplane.errors import sse_error_event
from narwhal.dataplane.exchange import Exchange, Result, Streamed
from narwhal.dataplane.leg import Attempt, Leg
from narwhal.dataplane.legs import Legs
from narwhal.dataplane.migration import Splice
from narwhal.dataplane.moves import MAINTENANCE, Moves, is_move
from narwhal.dataplane.outcomes import (
    ClientGone,
    DeadlineExceeded,
    Interrupted,
    Moved,
    cause,
    status_for,
)
from narwhal.dataplane.relay import Failure, Phase, Relay
from narwhal.dataplane.watchdog import ReadWatchdog
from narwhal.engine.failures import EngineFailure, FailureClass, SuccessKind
from narwhal.engine.h1 import EngineResponse
from narwhal.engine.transport import classify_exception
from narwhal.telemetry.metrics import Children

# A write to a client that left (aiohttp's ClientConnectionResetError is one too).
CLIENT_GONE = ConnectionResetError
# How long to wait, after [DONE], for the end of the engine's body so its connection can be
# reused. The client's response is already complete; past this the connection is closed.
_EOF_AFTER_DONE_S = 0.1


class Streams:
    def __init__(self, legs: Legs, moves: Moves, clock: Clock) -> None:
        self._legs = legs
        self._moves = moves
        self._clock = clock
        self._migrated = Children(legs.metrics.migrated_streams)

    async def run(self, exchange: Exchange, leg: Leg, url: str) -> Result:
        """Forward the engine's SSE stream as bytes, with first-token, idle and request
        deadlines; as whole events through the attempt's splice when the stream may
        migrate."""
        legs, attempt, engine = self._legs, leg.attempt, leg.engine
        splice = attempt.splice
        serving = legs.serving
        metrics = legs.metrics
        loop = asyncio.get_running_loop()
        # Deadlines on the loop's clock (what asyncio.timeout uses), derived from ours.
        request_deadline = leg.deadline + loop.time() - self._clock.monotonic()
        first_deadline = min(loop.time() + serving.first_token_timeout_s, request_deadline)
        relay = Relay(splice)
        leg_start = last_chunk = time.perf_counter()
        resp: EngineResponse | None = None
        legs.stats.request(engine.id)
        request = exchange.record.attempt_base if exchange.record is not None else None
        try:
            async with asyncio.timeout_at(None) as timer:
                watch = ReadWatchdog(
                    loop, timer, first_deadline, request_deadline, serving.stream_idle_timeout_s
                )
                if splice is not None:
                    self._moves.register(engine.id, attempt, request)
                try:
                    watch.reading()
                    # Serialised here and not kept: orjson's output holds a 4 KB buffer,
                    # which would otherwise stay allocated for the whole stream.
                    resp = await legs.client.stream(url, orjson.dumps(leg.body), leg.headers)
                    if resp.status != 200:
                        answer = await resp.read()
                        raise legs.status_failure(
                            engine, leg.name, resp.status, answer, resp.content_type
                        )
                    while True:
                        watch.reading()
                        chunk = await resp.readany()
                        watch.writing()
                        ended = not chunk
                        out = relay.feed(chunk)
                        if relay.phase is Phase.FAILED:
                            break
                        now = time.perf_counter()
                        if out:
                            try:
                                if not relay.started and relay.sent():
                                    attempt.started = True
                                    watch.started()
                                    legs.stats.latency(engine.id, now - leg_start)
                                    await self._open_stream(exchange, leg.deadline, splice, now)
                                else:
                                    metrics.inter_token.observe(now - last_chunk)
                                    legs.stats.inter_token(engine.id, now - last_chunk)
                                await exchange.send(out)
                            except CLIENT_GONE:
                                relay.client_gone()
                                raise ClientGone() from None
                            last_chunk = now
                            if splice is not None:
                                splice.last_sent_s = now
                        if relay.settle() or ended:
                            break  # the answer is complete, whether or not the engine hangs up
                except OSError as exc:
                    failure = classify_exception(exc, FailureClass.STREAM)
                    raise legs.fail(engine, leg.name, failure) from None
                finally:
                    watch.close()
                    if splice is not None:  # no move is asked for past this point
                        self._moves.unregister(engine.id, attempt, request)
        except TimeoutError:
            relay.timed_out(watch.writing_expired, loop.time() >= request_deadline - 1e-3)
            if relay.phase is Phase.DEADLINE and relay.write_timed_out:
                # The client stopped reading and let the request's deadline pass: not an
                # engine's fault. Cut it off so its data connection and the engine's slot free.
                exchange.cut_off()
                return Streamed("deadline")
            if relay.phase is Phase.DEADLINE:
                failed: Exception = DeadlineExceeded()
                return await self._end(exchange, attempt, engine.id, failed, request_deadline)
            assert relay.failure is not None
            return await self._engine_failed(exchange, leg, relay.failure, request_deadline)
        except asyncio.CancelledError:
            if splice is None or not is_move(attempt):
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            relay.moved()
            self._moved(attempt, engine.id)
        except EngineFailure as exc:
            return await self._end(exchange, attempt, engine.id, exc, request_deadline)
        except ClientGone:
            return Streamed("client_disconnect")
        finally:
            if resp is not None and not relay.complete:
                resp.close()  # the engine sees the disconnect and aborts
        return await self._finished(exchange, leg, relay, resp, request_deadline)

    async def _finished(
        self,
        exchange: Exchange,
        leg: Leg,
        relay: Relay,
        resp: EngineResponse | None,
        request_deadline: float,
    ) -> Result:
        """The engine's stream ended: judge how (a failed relay, no `[DONE]`, an in-band
        error, or a whole answer), settle the evidence, and finish the client's answer."""
        legs, attempt, engine, splice = self._legs, leg.attempt, leg.engine, leg.attempt.splice
        if relay.phase is Phase.FAILED:
            assert relay.failure is not None
            return await self._engine_failed(exchange, leg, relay.failure, request_deadline)
        relay.ended()
        assert resp is not None
        outcome = "ok"
        if relay.failure is Failure.NO_DONE:
            return await self._engine_failed(exchange, leg, Failure.NO_DONE, request_deadline)
        if relay.failure is Failure.ERROR_EVENT:
            # The engine reported an error in band (then [DONE]): the client has it as sent,
            # or, when the stream may migrate, it is continued elsewhere; the engine is
            # charged as for an error status.
            assert relay.scanner.error is not None
            detail = relay.scanner.error[:200].decode(errors="replace")
            failure = legs.fail(
                engine, leg.name, EngineFailure(FailureClass.INFERENCE_STATUS, detail)
            )
            if splice is not None:
                return await self._end(exchange, attempt, engine.id, failure, request_deadline)
            outcome = "upstream_error_midstream"
        else:
            legs.succeed(engine, leg.name, SuccessKind.DECODE_DONE)
            legs.check_recompute(leg, relay.scanner.last)
            if exchange.record is not None and (splice is None or not splice.migrations):
                # The engine's usage when the client asked for it; else what the splice
                # counted delivered (a continuation's is set by `migrate`).
                exchange.record.usage_source = (
                    relay.scanner.last
                    if splice is None or splice.usage_sent
                    else splice.usage_event()
                )
            if splice is not None and splice.migrations:
                self._migrated("saved").inc()
        exchange.settled_outcome = outcome
        await legs.evidence.settled()
        try:
            if not await finish(exchange, b"", request_deadline):
                outcome = "deadline"
        except BaseException:
            resp.close()
            raise
        await _release_at_eof(resp)
        return Streamed(outcome)

    async def _engine_failed(
        self, exchange: Exchange, leg: Leg, failure: Failure, until: float
    ) -> Result:
        """The engine failed the stream (`stream` class): charge it, then end the attempt."""
        charged = self._legs.fail(
            leg.engine,
            leg.name,
            EngineFailure(FailureClass.STREAM, failure.value, timed_out=failure.timed_out),
        )
        return await self._end(exchange, leg.attempt, leg.engine.id, charged, until)

    @staticmethod
    def _moved(attempt: Attempt, engine_id: str) -> NoReturn:
        """This stream was moved off its engine (planned maintenance, or preempted for a
        more urgent request): retried elsewhere before its first byte, continued elsewhere
        after it (`Interrupted`, with nothing charged)."""
        if not attempt.started:
            raise Moved()
        splice = attempt.splice
        assert splice is not None and attempt.moved is not None
        splice.interrupted_s = splice.last_sent_s
        detail = "preempted for a more urgent request"
        if attempt.moved == MAINTENANCE:
            detail = "moved off for planned maintenance"
        raise Interrupted(EngineFailure(FailureClass.STREAM, detail), attempt.moved, engine_id)

    async def _open_stream(
        self, exchange: Exchange, deadline: float, splice: Splice | None, now: float
    ) -> None:
        """An attempt's first bytes for the client: the stream's head and its time to first
        token, or, for a migrated stream, the gap the client saw."""
        metrics = self._legs.metrics
        if splice is not None and splice.opened:
            if splice.interrupted_s is not None:
                metrics.migration_gap.observe(now - splice.interrupted_s)
                splice.interrupted_s = None
            return
        record = exchange.record
        await exchange.start_stream({"X-Request-Id": record.request_id} if record else {})
        if splice is not None:
            splice.opened = True
        arrived = deadline - self._legs.serving.request_timeout_s
        ttft = self._clock.monotonic() - arrived
        metrics.ttft.observe(ttft)
        if record is not None:
            record.ttft_s = ttft

    async def _end(
        self,
        exchange: Exchange,
        attempt: Attempt,
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
            await self._legs.evidence.settled()  # placement sees the failed engine paused
            splice.interrupted_s = splice.last_sent_s
            raise Interrupted(failure, cause(failure), engine_id)
        return await self.error_event(exchange, failure, until)

    async def error_event(self, exchange: Exchange, failure: Exception, until: float) -> Result:
        """End a begun stream with an OpenAI-shaped error event."""
        status, message = status_for(failure)
        if exchange.record is not None:
            message = f"{message} (request {exchange.record.request_id})"
        await self._legs.evidence.settled()
        await finish(exchange, sse_error_event(message, "upstream_error", status), until)
        return Streamed("upstream_error_midstream")


async def finish(exchange: Exchange, last: bytes, until: float) -> bool:
    """Write `last` and end the client's response by `until` (loop time); False when the client
    did not take them in time and was cut off. A client that already left is not waited for."""
    try:
        async with asyncio.timeout_at(until):
            if last:
                await exchange.send(last)
            await exchange.end()
    except CLIENT_GONE:
        pass
    except TimeoutError:
        exchange.cut_off()
        return False
    return True


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
