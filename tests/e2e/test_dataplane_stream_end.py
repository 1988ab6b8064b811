"""How a decode stream ends: an in-band error event, and an engine that keeps the connection
open after `data: [DONE]`.

vLLM reports an error during generation as `data: {"error": ...}` then `[DONE]`: the client
gets the stream unchanged, and the decode engine is charged an `inference_status` failure (a
streak holds it for inference verification), never a completed decode. An engine that sends
`[DONE]` and then holds the connection open has answered: the router records the success, ends
the client's response at once, and hangs up on the engine (no `stream` failure, no error event
after `[DONE]`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from narwhal.engine.failures import FailureClass
from tests.support.http import metric
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory

MODEL = "demo-model"
PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]
NO_SWEEPS = {"monitor_interval_s": 30.0}  # one pass at start, then no probe during the test
DONE = b"data: [DONE]\n\n"


async def _stream(http: aiohttp.ClientSession, rr: RunningRouter) -> tuple[int, bytes]:
    body = {"model": MODEL, "prompt": "how streams end", "max_tokens": 8, "stream": True}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def _metric(
    http: aiohttp.ClientSession, rr: RunningRouter, name: str, **labels: str
) -> float:
    return await metric(http, rr.url, name, **labels)


# ------------------------------------------------------------------ in-band error events
async def test_an_in_band_error_event_is_forwarded_and_charged_as_inference_status(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": d0.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 100},
    )  # fmt: skip
    d0.add_fault({"kind": "error_event", "leg": "decode", "count": 1})

    status, raw = await _stream(http, rr)
    assert status == 200
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-2].startswith(b'data: {"error": {'), raw  # as the engine sent it
    assert raw.endswith(DONE)
    assert rr.router.fleet.get("d0").evidence == {FailureClass.INFERENCE_STATUS: 1}
    assert (
        await _metric(http, rr, "narwhal_leg_outcomes_total", engine="d0", leg="decode",
                      outcome="inference_status")
        == 1
    )  # fmt: skip
    assert (
        await _metric(http, rr, "narwhal_leg_outcomes_total", engine="d0", outcome="decode_done")
        == 0
    )

    # A clean stream afterwards clears the streak (decode reaching its terminal marker).
    status, raw = await _stream(http, rr)
    assert status == 200 and raw.endswith(DONE)
    assert rr.router.fleet.get("d0").evidence == {}


async def test_a_streak_of_in_band_errors_holds_the_decode_for_inference_verification(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": d0.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 2},
    )  # fmt: skip
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    d0.add_fault({"kind": "error_event", "leg": "decode", "count": 2})

    for _ in range(2):
        status, raw = await _stream(http, rr)
        assert status == 200 and b'data: {"error"' in raw
    assert "inference_verification" in rr.holds("d0")
    assert rr.holds("p0") == []
    assert rr.router.fleet.get("p0").evidence == {}


async def test_an_engine_that_keeps_sending_error_events_fails_its_inference_probe(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The hold's probe runs a real decode leg: an error event there fails it (eject), as on
    the data path, instead of passing the probe and clearing the hold."""
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": d0.url, "role": "decode"}],
        recovery={"eject_after": 2},
    )  # fmt: skip
    d0.add_fault({"kind": "error_event", "leg": "decode"})  # every decode, probes' included
    for _ in range(2):
        status, raw = await _stream(http, rr)
        assert status == 200 and b'data: {"error"' in raw

    def ejected() -> Any:
        return next(e for e in rr.router.engines_json() if e["id"] == "d0")["ejection"]

    record = await eventually(ejected, timeout_s=10, what="d0 ejected by its failed probe")
    assert record["cause"] == "inference_status", record


# ------------------------------------------------------------ an engine that stays after [DONE]
class LingeringEngine:
    """A tiny decode engine that sends its events and `[DONE]`, then keeps the connection open
    (until the router hangs up). It counts the requests whose connection the router closed."""

    def __init__(self) -> None:
        self.drop = False  # instead: drop the connection after the first event, no [DONE]
        self.bare_done = False  # instead: end with `data: [DONE]\n` and EOF (no blank line)
        self.hung_up = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id": "x", "choices": [{"index": 0, "text": "hi"}]}\n\n')
        if self.drop:
            assert request.transport is not None
            request.transport.abort()  # the connection drops mid-stream (a crash, a reset)
            return resp
        if self.bare_done:
            await resp.write(b"data: [DONE]\n")
            await resp.write_eof()
            return resp
        await resp.write(DONE)
        try:
            await asyncio.sleep(60)  # the body never ends on its own
        except asyncio.CancelledError:
            self.hung_up += 1  # the router closed the connection (handler cancellation)
            raise
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", _ok)
        app.router.add_get("/v1/models", _models)  # verified: serves demo-model
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def _models(_: web.Request) -> web.Response:
    """vLLM's model list naming the served model, so the router verifies this fake."""
    return web.json_response({"object": "list", "data": [{"id": "demo-model"}]})


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def lingering() -> AsyncIterator[LingeringEngine]:
    engine = LingeringEngine()
    await engine.start()
    yield engine
    await engine.stop()


async def test_done_ends_the_stream_even_if_the_engine_keeps_the_connection_open(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession,
    lingering: LingeringEngine,
) -> None:  # fmt: skip
    (p0,) = sim_factory.start_many([PREFILL])
    idle_s = 1.0
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": lingering.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 100},
        serving={"stream_idle_timeout_s": idle_s, "first_token_timeout_s": 2.0,
                 "request_timeout_s": 10},
    )  # fmt: skip

    started = time.monotonic()
    status, raw = await _stream(http, rr)
    elapsed = time.monotonic() - started

    assert status == 200
    assert raw.endswith(DONE), raw  # no error event after [DONE]
    assert elapsed < idle_s, "the client waited for the engine's silence"
    assert rr.router.fleet.get("d0").evidence == {}
    assert await _metric(http, rr, "narwhal_engine_failures_total") == 0
    assert (
        await _metric(http, rr, "narwhal_leg_outcomes_total", engine="d0", outcome="decode_done")
        == 1
    )
    await eventually(lambda: lingering.hung_up == 1, timeout_s=5, what="engine connection closed")
    assert rr.router.fleet.in_flight.of("d0") == 0


async def test_an_engine_connection_dropped_mid_stream_is_a_connection_failure(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession,
    lingering: LingeringEngine,
) -> None:  # fmt: skip
    """Decided in docs/dataplane.md: a dropped connection is `connection` (the spec's
    "connection error"), not the `stream` class's "invalid stream termination", which is a
    response that ends properly but without `[DONE]` or with a malformed event."""
    (p0,) = sim_factory.start_many([PREFILL])
    lingering.drop = True
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": lingering.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 100},
    )  # fmt: skip

    status, raw = await _stream(http, rr)

    assert status == 200  # the first event had reached the client
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[0].startswith(b'data: {"id": "x"'), raw
    assert events[-1].startswith(b'data: {"error":'), raw  # the router's error event
    assert not raw.endswith(DONE)
    assert rr.router.fleet.get("d0").evidence == {FailureClass.CONNECTION: 1}
    assert (
        await _metric(http, rr, "narwhal_leg_outcomes_total", engine="d0", outcome="connection")
        == 1
    )
    assert rr.router.fleet.in_flight.of("d0") == 0


async def test_a_successful_non_streamed_decode_clears_stream_evidence(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The spec's "decode stream reaching its terminal marker" row, for a JSON answer: a whole
    non-streamed answer is the decode completing (docs/dataplane.md)."""
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": d0.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 100},
    )  # fmt: skip
    d0.add_fault({"kind": "no_done", "leg": "decode", "count": 1})
    status, raw = await _stream(http, rr)
    assert status == 200 and not raw.endswith(DONE)
    assert rr.router.fleet.get("d0").evidence == {FailureClass.STREAM: 1}

    body = {"model": MODEL, "prompt": "a whole answer", "max_tokens": 4}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    assert rr.router.fleet.get("d0").evidence == {}


async def test_a_done_line_without_its_blank_line_at_eof_ends_the_stream(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession,
    lingering: LingeringEngine,
) -> None:  # fmt: skip
    """`data: [DONE]\n` then the body's end is a completed stream: no `stream` failure, no
    error event; the client gets the missing blank line so its SSE parser dispatches `[DONE]`."""
    (p0,) = sim_factory.start_many([PREFILL])
    lingering.bare_done = True
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": lingering.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 100},
    )  # fmt: skip

    status, raw = await _stream(http, rr)

    assert status == 200
    assert raw.endswith(DONE), raw
    assert b'"error"' not in raw, raw
    assert rr.router.fleet.get("d0").evidence == {}
    assert await _metric(http, rr, "narwhal_engine_failures_total") == 0
    assert (
        await _metric(http, rr, "narwhal_leg_outcomes_total", engine="d0", outcome="decode_done")
        == 1
    )
    assert await _metric(http, rr, "narwhal_requests_total", outcome="ok") == 1


# ------------------------------------------------------------ a client that leaves after [DONE]
async def _read_to_done_and_close(rr: RunningRouter) -> None:
    """A raw client: send a streamed completion, read until `data: [DONE]`, close at once (as
    the openai client does), without waiting for the end of the chunked body."""
    host, port = rr.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"model": "demo-model", "prompt": "leave early", "max_tokens": 4, "stream": true}'
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    seen = b""
    async with asyncio.timeout(10):
        while b"data: [DONE]" not in seen:
            chunk = await reader.read(65536)
            assert chunk, seen
            seen += chunk
    writer.transport.abort()


async def test_a_client_that_closes_right_after_done_is_counted_ok(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession,
    lingering: LingeringEngine,
) -> None:  # fmt: skip
    """Once `[DONE]` has reached the client the request is `ok` and the decode a success,
    whatever the client does next. The engine here holds its body open after `[DONE]`, so the
    router is still finishing when every one of these clients closes."""
    (p0,) = sim_factory.start_many([PREFILL])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": lingering.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 100},
    )  # fmt: skip
    n = 8
    for _ in range(n):
        await _read_to_done_and_close(rr)

    async def counted() -> bool:
        return await _metric(http, rr, "narwhal_requests_total") == n

    await eventually(counted, timeout_s=10, what="every request counted")
    assert await _metric(http, rr, "narwhal_requests_total", outcome="ok") == n
    assert await _metric(http, rr, "narwhal_requests_total", outcome="client_disconnect") == 0
    assert (
        await _metric(http, rr, "narwhal_leg_outcomes_total", engine="d0", outcome="decode_done")
        == n
    )
    assert rr.router.fleet.get("d0").evidence == {}


async def test_an_inference_probe_accepts_a_done_line_without_its_blank_line(
    sim_factory: SimFactory, start_router: StartRouter, lingering: LingeringEngine,
) -> None:  # fmt: skip
    """The probe's streamed leg ends the same way as the data plane's: `data: [DONE]\\n` then
    EOF is the terminal marker, not a `stream` failure."""
    (p0,) = sim_factory.start_many([PREFILL])
    lingering.bare_done = True
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": lingering.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 100},
    )  # fmt: skip
    body = {"model": MODEL, "prompt": "probe", "max_tokens": 1, "stream": True}
    last = await rr.router.prober.decode_leg(rr.router.fleet.get("d0"), body)
    assert last is not None and last.startswith(b'data: {"id": "x"'), last
