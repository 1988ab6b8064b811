"""`narwhal-sim bench`: how many completions per second an engine answers (closed loop).

Used to check that the simulator is not the bottleneck of a router benchmark, and, with the
shared-prefix workload, to show cache-aware placement at work in the demo.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import aiohttp

from narwhal.clock import Clock

REPEATED_PROMPT = "the quick brown fox jumps over the lazy dog " * 4
# Three letters and a space: four bytes a word, so a router without the model's tokenizer
# (four bytes a pseudo token, docs/placement.md) and the sim (a token a word) count alike.
_WORDS = (
    "sea", "sun", "sky", "oak", "elm", "ash", "bay", "cod", "day", "dew", "fog", "fox",
    "gem", "ice", "inn", "ivy", "jar", "key", "kit", "log", "map", "mud", "net", "oar",
    "owl", "paw", "pea", "pie", "pod", "ray", "rye", "sap", "saw", "tea", "tie", "toe",
    "urn", "van", "web", "yak",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Chat traffic with shared system prompts, in the shape of sglang's generated-shared-
    prefix set: `groups` long preambles (about `prefix_words` words each), each request one of
    them plus a short question of its own. Most of every prompt is some engine's cached
    prefix, if the router sends each group where it went before."""

    preambles: tuple[str, ...]

    @classmethod
    def generate(cls, rng: random.Random, groups: int, prefix_words: int) -> SharedPrefix:
        return cls(
            tuple(
                f"System {g}: " + " ".join(rng.choices(_WORDS, k=prefix_words))
                for g in range(groups)
            )
        )

    def prompt(self, rng: random.Random) -> str:
        question = " ".join(rng.choices(_WORDS, k=8))
        return f"{rng.choice(self.preambles)}\n\nQuestion: {question}?"


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
    model: str = "demo-model",
    workload: SharedPrefix | None = None,
    rng: random.Random | None = None,
) -> BenchResult:
    """Closed loop at `concurrency` for `duration_s`: the same prompt every time, or one of
    `workload`'s drawn with `rng`."""
    url = url.rstrip("/")
    rng = rng or random.Random()

    def body() -> dict[str, object]:
        prompt = REPEATED_PROMPT if workload is None else workload.prompt(rng)
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}

    counts = [0, 0]  # ok, errors
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = clock.monotonic()
        deadline = start + duration_s

        async def worker() -> None:
            while clock.monotonic() < deadline:
                try:
                    async with session.post(url + "/v1/completions", json=body()) as resp:
                        await resp.read()
                        counts[0 if resp.status == 200 else 1] += 1
                except aiohttp.ClientError:
                    counts[1] += 1

        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(worker())
        elapsed = clock.monotonic() - start
    return BenchResult(counts[0], counts[1], elapsed, concurrency)
