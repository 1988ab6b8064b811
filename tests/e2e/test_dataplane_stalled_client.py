"""A client that stops reading is cut off by the request's deadline (`serving.request_timeout_s`).

A raw socket with a tiny receive buffer sends a streaming request and never reads. The decode
sim streams a long answer at once, so the router's writes to the client block. By the request's
deadline the router must drop the client, free its data connection and the decode engine's
in-flight slot, abort the decode leg, and record no evidence against any engine (the client,
not an engine, ran out the clock).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.support.http import metric
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"
DEADLINE_S = 3.0
MAX_TOKENS = 60_000  # about 9 MB of SSE: more than every buffer between sim and client


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimProcess, SimProcess]]:
    factory = SimFactory()
    try:
        prefill, decode = factory.start_many(
            [["--role", "prefill", "--kv-role", "kv_producer", "--max-model-len", "100000"],
             ["--role", "decode", "--kv-role", "kv_consumer", "--max-model-len", "100000",
              "--itl-ms", "0"]]
        )  # fmt: skip
        yield prefill, decode
    finally:
        factory.close()


async def _stalled_client(url: str) -> socket.socket:
    """Send a streaming completion on a socket that never reads its answer."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (parts.hostname, parts.port))
    body = json.dumps(
        {"model": MODEL, "prompt": "never read", "max_tokens": MAX_TOKENS, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    await loop.sock_sendall(sock, head + body)
    return sock


def _drained_to_close(sock: socket.socket, timeout_s: float) -> bool:
    """Read what the router sent until the connection ends (True) or `timeout_s` passes."""
    sock.setblocking(True)
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


async def _metric(rr: RunningRouter, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as http:
        return await metric(http, rr.url, name, **labels)


async def test_a_client_that_stops_reading_is_cut_off_at_the_request_deadline(
    sims: tuple[SimProcess, SimProcess], start_router: StartRouter
) -> None:
    prefill, decode = sims
    # The decode sim formats its whole answer before it writes (`--itl-ms 0`), a CPU burst in
    # which its `/health` waits: 0.2 s alone, past the tests' 0.5 s health timeout on a loaded
    # host, which the monitor rightly charges as a `timeout`. This test is about what the data
    # plane charges, so the monitor's probes get the patience of a real deployment.
    rr = await start_router(
        [{"id": "p0", "url": prefill.url, "role": "prefill"},
         {"id": "d0", "url": decode.url, "role": "decode"}],
        recovery={"eject_after": 100, "liveness_misses": 100},
        serving={"request_timeout_s": DEADLINE_S, "first_token_timeout_s": 2.0,
                 "stream_idle_timeout_s": 1.0},
        engine={"health_timeout_s": 5.0},
    )  # fmt: skip

    def in_flight() -> int:
        return rr.router.fleet.in_flight.of("d0")

    started = time.monotonic()
    sock = await _stalled_client(rr.url)
    try:
        await eventually(lambda: in_flight() == 1, timeout_s=DEADLINE_S, what="decode started")
        await eventually(lambda: in_flight() == 0, timeout_s=DEADLINE_S + 10, what="slot freed")
        elapsed = time.monotonic() - started
        # Held while the client's window was shut (the answer never fit), freed at the deadline.
        assert DEADLINE_S - 0.5 <= elapsed < DEADLINE_S + 10
        # Given back when the request's handler returns, just after the engine's slot: with
        # workers, two writes to the shared table that this process may read between.
        await eventually(
            lambda: rr.router.data_pool_usage()[0] == 0, timeout_s=5, what="data connection back"
        )
        assert await asyncio.to_thread(_drained_to_close, sock, 10.0), "client not cut off"
    finally:
        sock.close()

    assert rr.router.fleet.get("d0").evidence == {}
    assert rr.router.fleet.get("p0").evidence == {}
    assert await _metric(rr, "narwhal_engine_failures_total") == 0
    assert await _metric(rr, "narwhal_requests_total", outcome="deadline") == 1
    # The decode leg was aborted: the sim is not still generating for nobody.
    await eventually(lambda: _idle(decode), timeout_s=10, what="decode leg aborted")


async def _idle(sim: SimProcess) -> bool:
    return await asyncio.to_thread(sim.metric, "vllm:num_requests_running") == 0
