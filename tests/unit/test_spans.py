"""Leg spans (dataplane/spans.py): with the request traced, each leg gets a child span that
names the attempt's trace context for the engine and ends failed when the leg raises; the
request's span ends with its status, outcome and counts. Untraced, every leg gets the one
shared no-op."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.dataplane.leg import Attempt
from narwhal.dataplane.record import RequestRecord
from narwhal.dataplane.spans import Spans
from tests.support.fake_exchange import FakeExchange


class FakeTracer:
    """`RequestTracer`'s calls, kept: spans are dicts, ends are (span name, attributes, ok)."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, dict[str, Any], bool]] = []
        self.shut = False

    def leg(self, parent: Any, name: str, attributes: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "parent": parent, **attributes}

    def headers(self, span: dict[str, Any]) -> dict[str, str]:
        return {"traceparent": f"00-{span['name']}-01"}

    def end(self, span: Any, attributes: dict[str, Any], ok: bool) -> None:
        self.ended.append((span["name"], dict(attributes), ok))

    def shutdown(self) -> None:
        self.shut = True


def _traced() -> tuple[Spans, FakeTracer, FakeExchange]:
    tracer = FakeTracer()
    record = RequestRecord("req", "chat", "req")
    record.span = {"name": "request"}
    return Spans(tracer), tracer, FakeExchange(record=record)


def test_a_leg_span_names_the_engines_trace_context_and_ends_ok() -> None:
    spans, tracer, exchange = _traced()
    attempt = Attempt("req-a1", {"traceparent": "from-the-client"})
    with spans.leg(exchange, attempt, "prefill", "p0"):
        assert attempt.trace == {"traceparent": "00-prefill-01"}
        assert tracer.ended == []
    assert tracer.ended == [("prefill", {}, True)]


def test_a_leg_that_raises_ends_its_span_failed() -> None:
    spans, tracer, exchange = _traced()
    with pytest.raises(RuntimeError), spans.leg(exchange, Attempt("req-a1", {}), "decode", "d0"):
        raise RuntimeError("the leg failed")
    assert tracer.ended == [("decode", {}, False)]


async def test_the_request_span_ends_with_what_became_of_the_request() -> None:
    spans, tracer, exchange = _traced()
    record = exchange.record
    assert record is not None
    record.status, record.model, record.attempts, record.migrations = 200, "m", 2, 1
    spans.end(record, "ok")
    spans.end(record, "upstream_error")
    expected = {
        "http.response.status_code": 200,
        "narwhal.model": "m",
        "narwhal.attempts": 2,
        "narwhal.migrations": 1,
    }
    assert tracer.ended == [
        ("request", {**expected, "narwhal.outcome": "ok"}, True),
        ("request", {**expected, "narwhal.outcome": "upstream_error"}, False),
    ]
    await spans.close()
    assert tracer.shut


async def test_untraced_legs_share_one_no_op_and_close_sends_nothing() -> None:
    spans = Spans(None)
    record = RequestRecord("req", "chat", "req")  # no span: the request is not traced
    attempt = Attempt("req-a1", {"traceparent": "from-the-client"})
    first = spans.leg(FakeExchange(record=record), attempt, "prefill", "p0")
    assert spans.leg(FakeExchange(), attempt, "decode", "d0") is first
    with first:
        pass
    assert attempt.trace == {"traceparent": "from-the-client"}
    await spans.close()
