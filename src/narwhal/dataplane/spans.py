"""A request's OpenTelemetry spans in the data plane (telemetry/tracing.py makes them): a
child span for each leg, whose context the engine gets as its `traceparent`, and the request
span's end with what became of the request. `DataPlane.handle` begins the request span
itself, inline, and only when tracing is on: every request passes there.

With tracing off a leg gets one shared no-op context, so an untraced leg pays one attribute
test and no frame of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from narwhal.dataplane.exchange import Exchange
from narwhal.dataplane.leg import Attempt
from narwhal.dataplane.record import RequestRecord
from narwhal.telemetry.tracing import RequestTracer

_UNTRACED = nullcontext()  # an untraced leg's span


class Spans:
    def __init__(self, tracer: RequestTracer | None) -> None:
        self._tracer = tracer

    def leg(
        self, exchange: Exchange, attempt: Attempt, leg: str, engine_id: str
    ) -> AbstractContextManager[None]:
        """A leg's span, open while the block runs and failed if it raises; it names the
        attempt's trace context (`attempt.trace`) for the engine. The shared no-op when the
        request has no span."""
        record = exchange.record
        if record is None or record.span is None:
            return _UNTRACED
        return self._leg_span(record, attempt, leg, engine_id)

    @contextmanager
    def _leg_span(
        self, record: RequestRecord, attempt: Attempt, leg: str, engine_id: str
    ) -> Iterator[None]:
        assert self._tracer is not None  # the request has a span
        attributes = {"narwhal.engine": engine_id, "narwhal.attempt_id": attempt.request_id}
        span = self._tracer.leg(record.span, leg, attributes)
        attempt.trace = self._tracer.headers(span)
        ok = False
        try:
            yield
            ok = True
        finally:
            self._tracer.end(span, {}, ok)

    def end(self, record: RequestRecord, outcome: str) -> None:
        """End the request's span (it has one) with its status, outcome and counts."""
        assert self._tracer is not None
        attributes = {
            "http.response.status_code": record.status,
            "narwhal.outcome": outcome,
            "narwhal.model": record.model or "",
            "narwhal.attempts": record.attempts,
            "narwhal.migrations": record.migrations,
        }
        self._tracer.end(record.span, attributes, ok=outcome == "ok")

    async def close(self) -> None:
        """Send the spans still batched (tracing on)."""
        if self._tracer is not None:
            await asyncio.to_thread(self._tracer.shutdown)
