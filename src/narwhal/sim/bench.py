"""`narwhal-sim bench`: how many completions per second an engine answers (closed loop).

Used to check that the simulator is not the bottleneck of a router benchmark.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from narwhal.clock import Clock


@dataclass(frozen=True, slots=True)
class BenchResult:
    requests: int
    errors: int
    elapsed_s: float
    concurrency: int

    @property
    def rate(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.requests} requests ({self.errors} errors) in {self.elapsed_s:.1f} s "
            f"at concurrency {self.concurrency}: {self.rate:.0f} requests/s"
        )


async def run_bench(
    url: str,
    *,
    concurrency: int,
    duration_s: float,
    max_tokens: int,
    stream: bool,
    clock: Clock,
) -> BenchResult:
    url = url.rstrip("/")
    body = {
        "prompt": "the quick brown fox jumps over the lazy dog " * 4,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    counts = [0, 0]  # ok, errors
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = clock.monotonic()
        deadline = start + duration_s

        async def worker() -> None:
            while clock.monotonic() < deadline:
                try:
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        counts[0 if resp.status == 200 else 1] += 1
                except aiohttp.ClientError:
                    counts[1] += 1

        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(worker())
        elapsed = clock.monotonic() - start
    return BenchResult(counts[0], counts[1], elapsed, concurrency)
