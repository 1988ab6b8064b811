"""OpenTelemetry spans (`tracing.otlp_endpoint`, issue 20 §2): one span for each client
request, a child for each engine leg, an event for each migration.

Optional twice over: the `tracing` extra installs the OpenTelemetry packages, and without
`otlp_endpoint` there is no tracer at all (`make_tracer` returns None, and the request path
only tests for None), so an untraced router pays nothing. A request span continues the
client's trace (`traceparent`, `tracestate`); each leg's span is what the engine gets as its
`traceparent`, so an engine that traces joins under the leg that called it. Spans are sent
over OTLP/HTTP in batches, from a thread of the SDK's, every `export_interval_s`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from narwhal.config import TracingConfig

log = logging.getLogger("narwhal.tracing")


class RequestTracer:
    """The spans of one data plane (a worker, or the one-process router)."""

    def __init__(self, config: TracingConfig) -> None:
        # Imported here: only a traced router needs the OpenTelemetry packages.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        assert config.otlp_endpoint is not None
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint.rstrip("/") + "/v1/traces")
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name})
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=config.export_interval_s * 1000)
        )
        self._tracer = self._provider.get_tracer("narwhal")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind
        self._status = (Status, StatusCode)
        self._in_context = set_span_in_context

    def request(self, trace: Mapping[str, str], attributes: Mapping[str, Any]) -> Any:
        """A client request's span, in the client's trace when it sent one."""
        context = self._propagator.extract(carrier=dict(trace))
        return self._tracer.start_span(
            "narwhal.request",
            context=context,
            kind=self._kind.SERVER,
            attributes=dict(attributes),
        )

    def leg(self, parent: Any, name: str, attributes: Mapping[str, Any]) -> Any:
        """An engine leg's span, a child of the request's."""
        return self._tracer.start_span(
            f"narwhal.{name}",
            context=self._in_context(parent),
            kind=self._kind.CLIENT,
            attributes=dict(attributes),
        )

    def headers(self, span: Any) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span`, for the engine's request."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(span))
        return carrier

    def end(self, span: Any, attributes: Mapping[str, Any], ok: bool) -> None:
        span.set_attributes(dict(attributes))
        if not ok:
            status, code = self._status
            span.set_status(status(code.ERROR))
        span.end()

    def shutdown(self) -> None:
        """Send what is still batched (at shutdown)."""
        self._provider.shutdown()


def make_tracer(config: TracingConfig) -> RequestTracer | None:
    """The tracer, or None when tracing is off or its packages are missing (said once)."""
    if config.otlp_endpoint is None:
        return None
    try:
        return RequestTracer(config)
    except ImportError as exc:
        log.error("tracing: %s; install narwhal-router[tracing] (spans are off)", exc)
        return None
