"""The engine transport over a real socket: what the router sends engines, request to request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.engine.transport import (
    ControlPoolBusy,
    EngineClient,
    PoolKind,
    control_get,
    engine_headers,
)
from narwhal.tls import engine_context
from tests.e2e.test_readmission_support import Pki
from tests.support.poll import eventually
from tests.support.sockets import client_sockets


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[str | None]]]:
    """An engine that sets a cookie on every answer and records the Cookie header it gets."""
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = web.json_response({"choices": []})
        response.set_cookie("session", "engine-affinity")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://localhost:{port}", seen  # a host name: aiohttp keeps no cookies for IPs
    await runner.cleanup()


async def test_an_engines_cookie_never_rides_on_later_requests(
    engine: tuple[str, list[str | None]],
) -> None:
    url, seen = engine
    client = EngineClient(4, 4)
    await client.start()
    try:
        for pool in (PoolKind.DATA, PoolKind.DATA, PoolKind.CONTROL):
            reply = await client.post(pool, url + "/v1/completions", b"{}", {}, 5.0)
            assert reply.status == 200
    finally:
        await client.close()
    # Requests from unrelated clients share the router's sessions: a cookie one engine answer
    # set must not be sent with the next request.
    assert seen == [None, None, None]


@pytest.fixture
async def compressing_engine() -> AsyncIterator[tuple[str, list[str | None]]]:
    """An engine that compresses every answer the client accepts compressed (as a proxy in
    front of vLLM may) and records the Accept-Encoding header it gets."""
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Accept-Encoding"))
        response = web.Response(body=b'{"kv_transfer_params": {"remote_port": 5600}}' * 40)
        response.enable_compression()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    app.router.add_get("/metrics", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


@dataclass(frozen=True)
class _KeyedEngine:
    url: str

    def resolved_api_key(self) -> str | None:
        return "k"


async def test_every_engine_request_asks_for_an_uncompressed_answer(
    compressing_engine: tuple[str, list[str | None]],
) -> None:
    """The router relays raw bytes (SSE) and parses handoffs from them: engines must never be
    invited to compress, on either pool, for POSTs or GETs."""
    url, seen = compressing_engine
    expected = b'{"kv_transfer_params": {"remote_port": 5600}}' * 40
    client = EngineClient(4, 4)
    await client.start()
    try:
        replies = [
            await client.post(PoolKind.DATA, url + "/v1/completions", b"{}", {}, 5.0),
            await client.post(PoolKind.CONTROL, url + "/v1/completions", b"{}", {}, 5.0),
            await client.get(PoolKind.DATA, url + "/metrics", 5.0),
            await client.get(PoolKind.CONTROL, url + "/metrics", 5.0),
            await control_get(client, _KeyedEngine(url), "/metrics", 5.0),
            await client.post(
                PoolKind.DATA, url + "/v1/completions", b"{}", engine_headers("k", "r-1"), 5.0
            ),
        ]
    finally:
        await client.close()
    assert seen == ["identity"] * len(replies)
    assert [r.body for r in replies] == [expected] * len(replies)


# ------------------------------------------------------------------ the pools' socket bounds


@dataclass
class Engines:
    urls: list[str]
    ports: set[int]
    release: asyncio.Event


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    """Three engines: `/health` answers at once (`/health/slow` after 10 ms), `/stream` sends
    a chunk and then holds the response open, `/hang` answers nothing, both until `release`
    is set."""
    release = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow_health(request: web.Request) -> web.Response:
        await asyncio.sleep(0.01)  # long enough for concurrent checks to overlap
        return web.Response(text="ok")

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await release.wait()
        return response

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/health/slow", slow_health)
    app.router.add_post("/v1/completions", health)
    app.router.add_post("/stream", stream)
    app.router.add_get("/hang", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    ports = []
    for _ in range(3):
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(runner.addresses[-1][1])
    yield Engines([f"http://127.0.0.1:{p}" for p in ports], set(ports), release)
    release.set()
    await runner.cleanup()


async def _settled_sockets(ports: set[int], at_most: int) -> int:
    """The socket count once closed transports have dropped their sockets (asyncio closes
    them a loop iteration later); fails if it never comes down to `at_most`."""
    return await eventually(
        lambda: (n := client_sockets(ports)) <= at_most and (n or -1),
        timeout_s=2,
        what=f"at most {at_most} sockets to the engines",
    )


async def test_the_control_pool_bound_counts_idle_keepalive_sockets(engines: Engines) -> None:
    """A bound on connections in use alone (aiohttp's `limit`) would let one control
    connection used for three engines in turn leave three idle keep-alive sockets open."""
    client = EngineClient(data_limit=4, control_limit=1)
    await client.start()
    try:
        for _ in range(2):
            for url in engines.urls:
                reply = await client.get(PoolKind.CONTROL, url + "/health", 5.0)
                assert reply.status == 200
                await _settled_sockets(engines.ports, 1)
        assert await _settled_sockets(engines.ports, 1) == 1  # the last one stays for reuse
        # Reuse is the hot path and opens nothing: the same engine again, same socket.
        reply = await client.get(PoolKind.CONTROL, engines.urls[-1] + "/health", 5.0)
        assert reply.status == 200 and await _settled_sockets(engines.ports, 1) == 1
    finally:
        await client.close()


async def test_the_data_pool_bound_counts_idle_prefill_sockets(engines: Engines) -> None:
    """The data plane's pattern: a short prefill leg on one engine, then a long decode stream
    on another. With 2 data connections, 2 requests could otherwise hold 2 streaming decode
    sockets and 2 idle prefill ones."""
    limit = 2
    client = EngineClient(data_limit=limit, control_limit=1)
    await client.start()
    prefill, decode = engines.urls[0], engines.urls[1]
    streams = []
    try:
        for _ in range(limit):
            reply = await client.post(PoolKind.DATA, prefill + "/v1/completions", b"{}", {}, 5.0)
            assert reply.status == 200
            await _settled_sockets(engines.ports, limit)
            resp = await client.stream(decode + "/stream", b"{}", {})
            assert await resp.readany() == b"data: 1\n\n"
            streams.append(resp)
            await _settled_sockets(engines.ports, limit)
        assert await _settled_sockets(engines.ports, limit) == limit  # the two streams
    finally:
        engines.release.set()
        for resp in streams:
            resp.release()
        await client.close()


async def test_concurrent_control_requests_to_more_engines_stay_within_the_bound(
    engines: Engines,
) -> None:
    """A monitor pass's shape: many checks at once over more engines than control
    connections. The real sockets, sampled between loop turns, never exceed the bound, and
    the bound is reached (else the sampler proves nothing)."""
    limit = 2
    client = EngineClient(data_limit=4, control_limit=limit)
    await client.start()
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, client_sockets(engines.ports))
            await asyncio.sleep(0)

    sampler = asyncio.create_task(sample())
    try:
        for _ in range(5):
            replies = await asyncio.gather(
                *(
                    client.get(PoolKind.CONTROL, url + "/health/slow", 5.0)
                    for url in engines.urls * 4
                )
            )
            assert [r.status for r in replies] == [200] * 12
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        await client.close()
    assert peak == limit, f"{peak} sockets open with control_connections {limit}"
    assert client.control_in_use == 0


# ------------------------------------------------------- one deadline for a control request


async def _timed_get(client: EngineClient, url: str, timeout_s: float) -> tuple[float, object]:
    started = time.monotonic()
    try:
        outcome: object = await client.get(PoolKind.CONTROL, url, timeout_s)
    except EngineFailure as exc:
        outcome = exc
    return time.monotonic() - started, outcome


async def _queued_behind(engines: Engines, hold_s: float, timeout_s: float) -> tuple[float, object]:
    """A control request queued behind one that holds the only control connection for
    `hold_s` (an engine that never answers), both to hanging engines."""
    client = EngineClient(data_limit=1, control_limit=1)
    await client.start()
    try:
        first = asyncio.create_task(_timed_get(client, engines.urls[0] + "/hang", hold_s))
        await eventually(lambda: client.control_in_use == 1, what="the first holds the pool")
        second = await _timed_get(client, engines.urls[1] + "/hang", timeout_s)
        await first
        return second
    finally:
        await client.close()


async def test_a_control_requests_wait_for_a_connection_counts_against_its_timeout(
    engines: Engines,
) -> None:
    """Waiting for a control connection and the request share one deadline: never twice the
    timeout. A short wait leaves the engine most of it, so a timeout is the engine's; a wait
    of more than half of it is `ControlPoolBusy`, never the engine's fault."""
    timeout_s = 2.0
    (short_s, short), (long_s, long) = await asyncio.gather(
        _queued_behind(engines, 0.7, timeout_s), _queued_behind(engines, 1.4, timeout_s)
    )
    # Separate deadlines would take 2.7 s and 3.4 s.
    assert short_s < timeout_s + 0.4, short_s
    assert long_s < timeout_s + 0.4, long_s
    assert isinstance(short, EngineFailure) and not isinstance(short, ControlPoolBusy), short
    assert short.failure_class is FailureClass.TIMEOUT
    assert isinstance(long, ControlPoolBusy), long


# ------------------------------------------------------------------ TLS on the control pool


@dataclass
class TlsEngine:
    url: str
    port: int
    ca: Path
    other_ca: Path


@pytest.fixture
async def tls_engine(tmp_path: Path) -> AsyncIterator[TlsEngine]:
    """An `https://` engine whose certificate chains to `ca` (not to `other_ca`): `/health`,
    and a streamed `/v1/completions` (two events, then `[DONE]`)."""
    pki = Pki(tmp_path / "pki")
    ca, other = pki.ca("engines-ca"), pki.ca("other-ca")
    cert, key = pki.issue("engines-ca", "engine", ["localhost"], ["127.0.0.1"])

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=Pki.server_context(cert, key))
    await site.start()
    port = runner.addresses[0][1]
    yield TlsEngine(f"https://127.0.0.1:{port}", port, ca, other)
    await runner.cleanup()


async def test_the_control_pool_speaks_tls_to_https_engines(tls_engine: TlsEngine) -> None:
    """As the data pool: verified against `engine.ca_file`, the socket kept for reuse, a
    streamed answer read as it comes (an inference probe's decode leg)."""
    client = EngineClient(4, 2, ssl_context=engine_context(str(tls_engine.ca)))
    await client.start()
    try:
        for _ in range(3):
            reply = await client.get(PoolKind.CONTROL, tls_engine.url + "/health", 5.0)
            assert (reply.status, reply.body) == (200, b"ok")
        assert await _settled_sockets({tls_engine.port}, 1) == 1  # one TLS socket, reused
        async with client.deadline(PoolKind.CONTROL, 5.0):
            resp = await client.stream(
                tls_engine.url + "/v1/completions", b"{}", {}, pool=PoolKind.CONTROL
            )
            try:
                assert (resp.status, resp.content_type) == (200, "text/event-stream")
                body = await resp.read()
            finally:
                resp.release()
            assert client.control_in_use == 1
        assert body == b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
        assert client.control_in_use == 0
    finally:
        await client.close()


async def test_an_engine_certificate_from_another_ca_is_a_connection_failure(
    tls_engine: TlsEngine,
) -> None:
    client = EngineClient(4, 2, ssl_context=engine_context(str(tls_engine.other_ca)))
    await client.start()
    try:
        with pytest.raises(EngineFailure) as failed:
            await client.get(PoolKind.CONTROL, tls_engine.url + "/health", 5.0)
    finally:
        await client.close()
    assert failed.value.failure_class is FailureClass.CONNECTION
    assert "CERTIFICATE_VERIFY_FAILED" in failed.value.detail
    assert client.control_in_use == 0
