"""Connection pools and sockets: the data pool's bound, saturation answers, the control pool's
independence, the bounded queue, and TCP_NODELAY on both sides of the router.

The decode sims stream slowly (`--itl-ms 50`) so that requests overlap for about a second.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.control.health import Answer, check_health
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"
ITL_MS = 50
HEALTH_TIMEOUT_S = 0.5

# Exact per-process pool and socket counts: one data plane.
pytestmark = pytest.mark.single_process


@dataclass
class Sims:
    prefill: SimProcess
    d0: SimProcess
    d1: SimProcess

    def all(self) -> tuple[SimProcess, ...]:
        return self.prefill, self.d0, self.d1


@pytest.fixture(scope="module")
def shared() -> Iterator[Sims]:
    factory = SimFactory()
    d = ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", str(ITL_MS)]
    try:
        yield Sims(*factory.start_many([["--role", "prefill", "--kv-role", "kv_producer"], d, d]))
    finally:
        factory.close()


async def _running(sim: SimProcess) -> float:
    return await asyncio.to_thread(sim.metric, "vllm:num_requests_running")


async def _decode_running(sims: Sims) -> float:
    counts = await asyncio.gather(_running(sims.d0), _running(sims.d1))
    return sum(counts)


@pytest.fixture
async def sims(shared: Sims) -> Sims:
    for sim in shared.all():
        sim.clear_faults()

        async def idle(s: SimProcess = sim) -> bool:
            return await _running(s) == 0

        await eventually(idle, timeout_s=5, what="sim idle")
        sim.clear_requests()
    return shared


def _engines(sims: Sims) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": sims.prefill.url, "role": "prefill"},
        {"id": "d0", "url": sims.d0.url, "role": "decode"},
        {"id": "d1", "url": sims.d1.url, "role": "decode"},
    ]


@dataclass
class Result:
    status: int
    retry_after: str | None
    body: bytes


async def _stream(http: aiohttp.ClientSession, url: str, max_tokens: int) -> Result:
    body = {"model": MODEL, "prompt": "a slow stream", "max_tokens": max_tokens, "stream": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        return Result(resp.status, resp.headers.get("Retry-After"), await resp.read())


@dataclass
class Peaks:
    """The highest values seen by a sampler running next to the load."""

    pool_in_use: int = 0
    pool_waiting: int = 0
    decode_running: float = 0
    samples: int = 0


async def _sample_router(rr: RunningRouter, peaks: Peaks) -> None:
    pool = rr.router.dataplane.pool
    while True:
        peaks.pool_in_use = max(peaks.pool_in_use, pool.in_use)
        peaks.pool_waiting = max(peaks.pool_waiting, pool.waiting)
        peaks.samples += 1
        await asyncio.sleep(0.002)


async def _sample_sims(sims: Sims, peaks: Peaks) -> None:
    """Every 10 ms: a stream runs ~1 s, so no peak is missed. Unpaced, the sampler's own
    `/metrics` requests kept the decode sims so busy that a health check of theirs took
    over the 0.5 s health timeout and counted as an engine failure."""
    while True:
        peaks.decode_running = max(peaks.decode_running, await _decode_running(sims))
        await asyncio.sleep(0.01)


def _assert_complete(result: Result) -> None:
    assert result.status == 200, result.body
    assert result.body.rstrip().endswith(b"data: [DONE]")


async def _engine_failures(http: aiohttp.ClientSession, rr: RunningRouter) -> dict[str, float]:
    """Engine failures counted so far, by engine and class (none counted: empty)."""
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    return {
        f"{s.labels['engine']}/{s.labels['failure_class']}": s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "narwhal_engine_failures_total" and s.value
    }


# ------------------------------------------------------------------ the data pool bound

LIMIT = 4
CLIENTS = 20


async def test_data_pool_bound_saturation_and_a_free_control_pool(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await start_router(
        _engines(sims),
        serving={"max_connections": LIMIT},
        engine={"health_timeout_s": HEALTH_TIMEOUT_S, "control_connections": 2},
    )
    peaks = Peaks()
    samplers = [
        asyncio.create_task(_sample_router(rr, peaks)),
        asyncio.create_task(_sample_sims(sims, peaks)),
    ]
    try:
        # 20 token-by-token streams of about a second each, all at once.
        load = asyncio.gather(*(_stream(http, rr.url, 20) for _ in range(CLIENTS)))
        await eventually(lambda: rr.router.dataplane.pool.in_use == LIMIT, what="pool full")

        async def saturated() -> bool:
            return await _decode_running(sims) == LIMIT

        await eventually(saturated, timeout_s=5, what="decode engines saturated")

        # The control pool is not starved: a full health sweep and readiness stay prompt.
        started = time.monotonic()
        await rr.router.health.health(rr.router.clock.monotonic())
        sweep_s = time.monotonic() - started
        for engine in rr.router.fleet:
            result = await check_health(
                rr.router.client, rr.router.adapters, engine, HEALTH_TIMEOUT_S
            )
            assert result.answer is Answer.OK, result
        started = time.monotonic()
        async with http.get(rr.url + "/ready") as resp:
            assert (resp.status, await resp.text()) == (200, "ready")
        ready_s = time.monotonic() - started
        assert rr.router.dataplane.pool.in_use == LIMIT, "still saturated while we checked"

        results = await load
    finally:
        for task in samplers:
            task.cancel()
        await asyncio.gather(*samplers, return_exceptions=True)

    # Queued behind the data connections, the sweep would wait for a stream to end (~1 s)
    # and time out at 0.5 s; on its own pool it answers at once.
    assert sweep_s < HEALTH_TIMEOUT_S, f"health sweep took {sweep_s:.3f}s"
    assert ready_s < 0.5
    ok = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status != 200]
    assert len(ok) == LIMIT
    for r in ok:
        _assert_complete(r)
    assert len(refused) == CLIENTS - LIMIT
    for r in refused:
        assert r.status == 503, r.body
        assert r.retry_after is not None and int(r.retry_after) >= 1
        assert b'"error"' in r.body
    assert peaks.samples > 50
    assert peaks.pool_in_use == LIMIT
    assert peaks.decode_running == LIMIT  # never more than the bound reached the engines
    assert len(sims.prefill.requests()) == LIMIT
    assert len(sims.d0.requests()) + len(sims.d1.requests()) == LIMIT
    # A stream's connection is given back once the engine's body has ended, just after the
    # client's answer was complete (`_release_at_eof`): not necessarily before the client saw it.
    await eventually(lambda: rr.router.dataplane.pool.in_use == 0, timeout_s=2, what="pool freed")
    assert all(e["in_flight"] == 0 for e in rr.router.engines_json())
    assert await _engine_failures(http, rr) == {}, "saturating the router is no engine failure"


async def _sample_engine_sockets(ports: set[int], peak: list[int]) -> None:
    """The highest number of the router's real TCP sockets to the engines (in use and idle),
    read from /proc, beside the load."""
    while True:
        peak[0] = max(peak[0], sum(s.peer[1] in ports for s in _tcp_sockets()))
        peak[1] += 1
        await asyncio.sleep(0.005)


async def test_open_upstream_sockets_never_exceed_the_pool_bounds(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Counted on the router's real sockets, not its own counters: a limit on connections in
    use alone (aiohttp's) would let 4 streaming decodes also keep 4 idle prefill sockets open,
    and health checks over one control connection one idle socket per engine.

    Nothing else in this process talks to the engines while the sampler runs (the sims'
    urllib helpers are not polled), so every socket to an engine port is the router's: at
    most `max_connections` on the data pool and `control_connections` on the control pool.
    """
    control = 1
    rr = await start_router(
        _engines(sims),
        serving={"max_connections": LIMIT},
        engine={"health_timeout_s": HEALTH_TIMEOUT_S, "control_connections": control},
    )
    ports = {sim.port for sim in sims.all()}
    peak = [0, 0]
    sampler = asyncio.create_task(_sample_engine_sockets(ports, peak))
    try:
        passes = rr.router.monitor.status.passes
        await eventually(lambda: rr.router.monitor.status.passes >= passes + 2, what="sweeps")
        # Until the load starts only the control pool talks to the engines: three engines
        # checked concurrently every pass, over one connection, keep one socket open, not
        # one idle keep-alive socket per engine.
        control_only = peak[0]
        load = asyncio.gather(*(_stream(http, rr.url, 20) for _ in range(CLIENTS)))
        await eventually(lambda: rr.router.dataplane.pool.in_use == LIMIT, what="pool full")
        results = await load
        # Health sweeps over the control pool go on while the data sockets idle.
        passes = rr.router.monitor.status.passes
        await eventually(lambda: rr.router.monitor.status.passes >= passes + 3, what="sweeps")
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    assert sorted(r.status for r in results).count(200) == LIMIT
    assert peak[1] > 50
    assert control_only == control, f"{control_only} control sockets open to the engines"
    assert peak[0] <= LIMIT + control, f"{peak[0]} sockets open to the engines"


async def test_bounded_policy_queues_up_to_queue_limit(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """2 connections, 2 queue places: of 6 concurrent streams 4 are served, 2 refused."""
    rr = await start_router(
        _engines(sims),
        serving={"max_connections": 2, "policy": "bounded", "queue_limit": 2},
    )
    peaks = Peaks()
    sampler = asyncio.create_task(_sample_router(rr, peaks))
    try:
        results = await asyncio.gather(*(_stream(http, rr.url, 10) for _ in range(6)))
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    statuses = sorted(r.status for r in results)
    assert statuses == [200, 200, 200, 200, 503, 503]
    for r in results:
        if r.status == 200:
            _assert_complete(r)
        else:
            assert r.retry_after is not None
    assert peaks.pool_in_use == 2 and peaks.pool_waiting == 2
    assert len(sims.d0.requests()) + len(sims.d1.requests()) == 4


# ---------------------------------------------------------------------------- sockets


@dataclass(frozen=True)
class TcpSocket:
    local: tuple[str, int]
    peer: tuple[str, int]
    nodelay: bool


def _tcp_sockets() -> list[TcpSocket]:
    """This process's connected TCP sockets (the router runs in-process), read from /proc.

    Each fd is duplicated, so the options read are those of the very socket the router uses.
    """
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(fd)
        except OSError:
            continue
        with socket.socket(fileno=dup) as sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                continue  # listening or not connected
            nodelay = bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            found.append(TcpSocket(sock.getsockname()[:2], peer[:2], nodelay))
    return found


def _raw_stream(port: int, max_tokens: int, started: asyncio.Event, loop: Any) -> list[Any]:
    """A plain blocking socket client; returns (arrival time, bytes) per recv."""
    body = json.dumps(
        {"model": MODEL, "prompt": "nagle", "stream": True, "max_tokens": max_tokens}
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    reads = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        loop.call_soon_threadsafe(started.set)
        while chunk := sock.recv(65536):
            reads.append((time.monotonic(), chunk))
    return reads


async def test_tcp_nodelay_on_client_and_upstream_sockets(
    sims: Sims, start_router: StartRouter
) -> None:
    rr = await start_router(_engines(sims))
    port = int(rr.url.rsplit(":", 1)[1])
    tokens = 16  # about 0.8 s of streaming
    loop = asyncio.get_running_loop()
    started = asyncio.Event()
    client = asyncio.create_task(asyncio.to_thread(_raw_stream, port, tokens, started, loop))
    await started.wait()

    async def decoding() -> bool:
        return await _decode_running(sims) == 1

    await eventually(decoding, timeout_s=5, what="the stream is being decoded")
    sockets = _tcp_sockets()
    server_side = [s for s in sockets if s.local[1] == port]
    decode_ports = {sims.d0.port, sims.d1.port}
    engine_ports = {sims.prefill.port, *decode_ports}
    upstream = [s for s in sockets if s.peer[1] in engine_ports]
    assert server_side, "the router's accepted socket for our client"
    assert any(s.peer[1] in decode_ports for s in upstream), "the router's decode connection"
    assert all(s.nodelay for s in server_side), server_side
    assert all(s.nodelay for s in upstream), upstream
    await client


async def test_stream_chunks_are_forwarded_as_they_come(
    sims: Sims, start_router: StartRouter
) -> None:
    """Tokens reach a plain socket client spread over the stream, not batched at its end."""
    rr = await start_router(_engines(sims))
    port = int(rr.url.rsplit(":", 1)[1])
    tokens = 30
    started = asyncio.Event()
    loop = asyncio.get_running_loop()
    reads = await asyncio.to_thread(_raw_stream, port, tokens, started, loop)
    raw = b"".join(chunk for _, chunk in reads)
    assert raw.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]\n\n" in raw and raw.endswith(b"0\r\n\r\n")  # chunked, complete
    carrying = [t for t, chunk in reads if b'"text"' in chunk]
    assert len(carrying) >= tokens // 3, f"{len(carrying)} reads for {tokens} tokens"
    assert carrying[-1] - carrying[0] >= (tokens - 1) * ITL_MS / 1000 * 0.5
