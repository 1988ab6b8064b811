"""OpenTelemetry spans (issue 20 §2): with `tracing.otlp_endpoint`, each request is a span in
the client's trace, each engine leg a child span whose context the engine gets as its
`traceparent`. The spans reach a real OTLP/HTTP receiver (an aiohttp server that parses the
protobuf export requests with OpenTelemetry's own message classes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support.poll import eventually
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer"]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[str, list[Any]]]:
    """An OTLP/HTTP trace receiver: its base URL, and every span it was sent."""
    spans: list[Any] = []

    async def export(request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                spans.extend(scope.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", spans
    finally:
        await runner.cleanup()


async def test_a_request_and_its_legs_are_spans_in_the_clients_trace(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    receiver: tuple[str, list[Any]],
) -> None:
    url, spans = receiver
    sims = sim_factory.start_many([P, D])
    rr = await start_router(
        [{"id": "p0", "url": sims[0].url, "role": "prefill"},
         {"id": "d0", "url": sims[1].url, "role": "decode"}],
        tracing={"otlp_endpoint": url, "export_interval_s": 0.1},
    )  # fmt: skip
    headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "X-Request-Id": "traced-1"}
    body = {"model": "demo-model", "prompt": "trace it", "max_tokens": 3, "stream": True}
    async with http.post(rr.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        await resp.read()

    def named(name: str) -> Any:
        return next((s for s in spans if s.name == name), None)

    await eventually(
        lambda: all(named(n) for n in ("narwhal.request", "narwhal.prefill", "narwhal.decode")),
        timeout_s=10,
        what="the request's spans exported",
    )
    request, prefill, decode = (
        named(n) for n in ("narwhal.request", "narwhal.prefill", "narwhal.decode")
    )
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == CLIENT_SPAN
    for leg in (prefill, decode):
        assert leg.trace_id == request.trace_id and leg.parent_span_id == request.span_id
    attributes = {a.key: a.value for a in request.attributes}
    assert attributes["narwhal.request_id"].string_value == "traced-1"
    assert attributes["narwhal.outcome"].string_value == "ok"
    # Each engine got its leg's span as its parent.
    for sim, leg in ((sims[0], prefill), (sims[1], decode)):
        sent = [
            r["headers"]["traceparent"] for r in sim.requests() if r["path"] == "/v1/completions"
        ]
        assert sent == [f"00-{TRACE_ID}-{leg.span_id.hex()}-01"]
