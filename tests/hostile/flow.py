"""The legitimate flow: a steady trickle of real requests through the router while a hostile
case runs, as its own process (so its timing is not the test process's, nor the router's).

`python -m tests.hostile.flow URL OUT` runs LANES lanes, each its own official `openai`
client (one keep-alive connection), alternating a JSON completion and a streamed chat, with
a short pause between requests. Each finished request appends one JSON line to OUT:
`{"lane", "start", "latency_s", "ok", "error"}` (`start` is `time.monotonic()`, which Linux
shares between processes). It runs until its stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from typing import Any, TextIO

import openai

MODEL = "demo-model"
LANES = 2
PAUSE_S = 0.05
TIMEOUT_S = 30.0


async def _one(client: openai.AsyncOpenAI, n: int) -> None:
    if n % 2:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"legit chat {n}"}],
            max_tokens=8,
            stream=True,
        )
        chunks = [c async for c in stream]
        if not chunks:
            raise RuntimeError("an empty stream")
    else:
        answer = await client.completions.create(model=MODEL, prompt=f"legit {n}", max_tokens=8)
        if not answer.choices[0].text:
            raise RuntimeError("an empty completion")


async def _lane(url: str, lane: int, out: TextIO, stop: asyncio.Event) -> None:
    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="sk-legit", max_retries=0, timeout=TIMEOUT_S
    )
    n = 0
    try:
        while not stop.is_set():
            n += 1
            start = time.monotonic()
            error: str | None = None
            try:
                await _one(client, n)
            except Exception as exc:  # every failure is the flow's result, not its end
                error = f"{type(exc).__name__}: {exc}"
            record: dict[str, Any] = {
                "lane": lane,
                "start": start,
                "latency_s": time.monotonic() - start,
                "ok": error is None,
                "error": error,
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PAUSE_S)
    finally:
        await client.close()


async def _main(url: str, out: TextIO) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stdin_closed() -> None:
        if not sys.stdin.buffer.read1(4096):
            loop.remove_reader(sys.stdin.fileno())
            stop.set()

    loop.add_reader(sys.stdin.fileno(), stdin_closed)
    async with asyncio.TaskGroup() as tg:
        for lane in range(LANES):
            tg.create_task(_lane(url, lane, out, stop))


if __name__ == "__main__":
    with open(sys.argv[2], "a", encoding="utf-8") as records:
        asyncio.run(_main(sys.argv[1], records))
