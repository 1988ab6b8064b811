"""The benchmark's c=1 paired run and its floor proxy, end to end on real sims.

`bench.floor` must really relay a PD round trip (both stream modes), and a paired run must
measure every target in each round and report latencies, so the c=1 target in
docs/benchmarks.md rests on a working measurement.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import pytest
from bench.loadgen.client import Client
from bench.loadgen.spec import RunSpec

from tests.support.poll import eventually
from tests.support.ports import free_port
from tests.support.sim_process import SimFactory, SimProcess


@pytest.fixture
def floor(sim_factory: SimFactory) -> Iterator[tuple[str, SimProcess, SimProcess]]:
    prefill, decode = sim_factory.start_many(
        [["--role", "prefill", "--kv-role", "kv_producer"],
         ["--role", "decode", "--kv-role", "kv_consumer"]]
    )  # fmt: skip
    port = free_port()
    argv = [sys.executable, "-m", "bench.floor", "--port", str(port)]
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


@pytest.mark.parametrize("stream", ["no", "yes"])
async def test_paired_run_measures_direct_and_the_floor_each_round(
    floor: tuple[str, SimProcess, SimProcess], stream: str
) -> None:
    url, prefill, decode = floor
    await eventually(lambda: _up(url), timeout_s=20, what="bench.floor listening")
    spec = RunSpec(
        name="paired",
        target="direct",
        concurrency=1,
        max_requests=8,
        duration_s=30.0,
        deadline_s=10.0,
        model="demo-model",
        stream=stream,
        prefill=(prefill.url,),
        decode=(decode.url,),
        max_tokens=4,
        warmup_requests=2,
        paired=("", url + "/v1/completions"),
    )
    client = Client()
    try:
        result = await asyncio.wait_for(client.paired(spec), 60)
    finally:
        await client.close()
    assert result.failed == {}
    assert [row["target"] for row in result.paired] == ["", url + "/v1/completions"]
    for row in result.paired:
        assert row["rounds"] == 6  # 8 rounds, the first 2 warm-up
        assert row["failed"] == 0
        assert row["latency_ms"]["p50"] > 0
        assert not math.isnan(row["diff_p50_ms"])
        if stream == "yes":
            assert 0 < row["ttft_ms"]["p50"] <= row["latency_ms"]["p50"]
    assert result.paired[0]["diff_p50_ms"] == 0.0
    # Both legs of every floor request reached the engines: prefill then decode.
    assert len(prefill.requests()) == len(decode.requests()) == 16
