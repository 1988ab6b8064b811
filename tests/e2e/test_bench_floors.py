"""The HTTP stack A/B's other floors really relay a PD round trip in both stream modes, over
keep-alive client connections, so the comparison in docs/benchmarks.md is between stacks doing
the same work: `bench.floor_raw` (asyncio protocols + httptools, on uvloop, through
`bench.uvrun`) and `bench.floor_granian` (granian serving, aiohttp client).

Both need packages of bench/.venv (made by `make bench`): skipped where it lacks them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
from bench.routers import granian_argv
from bench.venv import VENV, BenchVenv

from tests.support.etcd import free_port
from tests.support.poll import eventually
from tests.support.sim_process import SimFactory, SimProcess


def _has(package: str) -> bool:
    return any(VENV.glob(f"lib/python3*/site-packages/{package}"))


FLOORS = [
    pytest.param(
        "floor-raw",
        marks=pytest.mark.skipif(
            not (_has("uvloop") and _has("httptools")), reason="no uvloop/httptools in bench/.venv"
        ),
    ),
    pytest.param(
        "floor-granian",
        marks=pytest.mark.skipif(not _has("granian"), reason="no granian in bench/.venv"),
    ),
]


@pytest.fixture(params=FLOORS)
def floor(
    request: pytest.FixtureRequest, sim_factory: SimFactory
) -> Iterator[tuple[str, SimProcess, SimProcess]]:
    prefill, decode = sim_factory.start_many(
        [["--role", "prefill", "--kv-role", "kv_producer"],
         ["--role", "decode", "--kv-role", "kv_consumer"]]
    )  # fmt: skip
    port = free_port()
    env = dict(os.environ)
    if request.param == "floor-raw":
        argv = [sys.executable, "-m", "bench.uvrun", "bench.floor_raw", "--port", str(port)]
        argv += ["--prefill", prefill.url, "--decode", decode.url]
    else:
        argv = granian_argv(BenchVenv(), port)
        env |= {"FLOOR_PREFILL": prefill.url, "FLOOR_DECODE": decode.url}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)
    try:
        yield f"http://127.0.0.1:{port}", prefill, decode
    finally:
        proc.terminate()
        proc.wait(10)


async def _up(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


@pytest.mark.parametrize("stream", [False, True])
async def test_floor_relays_the_pd_round_trip(
    floor: tuple[str, SimProcess, SimProcess], stream: bool
) -> None:
    url, prefill, decode = floor
    await eventually(lambda: _up(url), timeout_s=20, what="the floor listening")
    body = {"model": "demo-model", "prompt": "w1 w2 w3", "max_tokens": 4, "stream": stream}
    connector = aiohttp.TCPConnector(limit=1)  # one connection: keep-alive is exercised
    async with aiohttp.ClientSession(connector=connector) as s:
        for _ in range(3):
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                raw = await r.read()
            if stream:
                assert r.headers["Content-Type"] == "text/event-stream"
                events = [e for e in raw.split(b"\n\n") if e]
                assert events[-1] == b"data: [DONE]"
                assert len(events) == 5  # four tokens, then [DONE]
            else:
                doc = orjson.loads(raw)
                assert len(doc["choices"][0]["text"].split()) == 4
    legs = [
        (p["body"]["kv_transfer_params"], d["body"]["kv_transfer_params"])
        for p, d in zip(prefill.requests(), decode.requests(), strict=True)
    ]
    assert len(legs) == 3
    for sent, spliced in legs:
        assert sent["do_remote_decode"] is True  # the prefill leg asked for a handoff
        assert spliced["do_remote_prefill"] is True  # the decode leg carried it
