"""`bench.floor_raw` (the floor on asyncio protocols + httptools, on uvloop) really relays a PD
round trip in both stream modes, over keep-alive connections on both sides, so the HTTP stack
A/B in docs/benchmarks.md compares stacks doing the same work.

It runs through `bench.uvrun`, which borrows uvloop and httptools from bench/.venv: skipped
where that venv (made by `make bench`) lacks them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
from bench.venv import VENV

from tests.support.etcd import free_port
from tests.support.poll import eventually
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.skipif(
    not any(VENV.glob("lib/python3*/site-packages/httptools"))
    or not any(VENV.glob("lib/python3*/site-packages/uvloop")),
    reason="bench/.venv has no uvloop and httptools (make bench creates it)",
)


@pytest.fixture
def floor_raw(sim_factory: SimFactory) -> Iterator[tuple[str, SimProcess, SimProcess]]:
    prefill, decode = sim_factory.start_many(
        [["--role", "prefill", "--kv-role", "kv_producer"],
         ["--role", "decode", "--kv-role", "kv_consumer"]]
    )  # fmt: skip
    port = free_port()
    argv = [sys.executable, "-m", "bench.uvrun", "bench.floor_raw", "--port", str(port)]
    argv += ["--prefill", prefill.url, "--decode", decode.url]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
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
async def test_floor_raw_relays_the_pd_round_trip(
    floor_raw: tuple[str, SimProcess, SimProcess], stream: bool
) -> None:
    url, prefill, decode = floor_raw
    await eventually(lambda: _up(url), timeout_s=20, what="bench.floor_raw listening")
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
