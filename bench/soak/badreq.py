"""Client errors mixed into the soak: malformed bodies and prompts longer than the model allows.
Each must be answered 4xx by the router, never 5xx, whatever the fleet is going through."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable

import aiohttp

TOO_LONG_WORDS = 5000  # the sims' --max-model-len is 4096 (one token per word)


def bodies(model: str) -> dict[str, bytes]:
    m = json.dumps(model)
    long_prompt = " ".join(f"x{i % 97}" for i in range(TOO_LONG_WORDS))
    return {
        "malformed_json": b'{"model": ' + m.encode() + b', "prompt": "hi',
        "not_an_object": b'["hi", 4]',
        "no_prompt": f'{{"model": {m}, "max_tokens": 4}}'.encode(),
        "max_tokens_negative": f'{{"model": {m}, "prompt": "hi", "max_tokens": -3}}'.encode(),
        "stream_not_bool": f'{{"model": {m}, "prompt": "hi", "stream": "yes"}}'.encode(),
        "prompt_too_long": json.dumps(
            {"model": model, "prompt": long_prompt, "max_tokens": 4}
        ).encode(),
        "prompt_too_long_stream": json.dumps(
            {"model": model, "prompt": long_prompt, "max_tokens": 4, "stream": True}
        ).encode(),
    }


async def send_bad(
    rng: random.Random,
    model: str,
    url: Callable[[], str | None],  # the router to send to now (None: skip this turn)
    until: float,
    every_s: float,
    timeout_s: float,
) -> list[tuple[float, str, int | None]]:
    """One bad request every `every_s` until `until` (monotonic): (t, kind, status), status 0
    for a lost connection, None for no answer in time."""
    kinds = bodies(model)
    names = sorted(kinds)
    out: list[tuple[float, str, int | None]] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < until:
            await asyncio.sleep(every_s)
            base = url()
            if base is None:
                continue
            kind = rng.choice(names)
            t = time.monotonic()
            status: int | None = None
            try:
                async with session.post(
                    base + "/v1/completions", data=kinds[kind], headers=headers
                ) as resp:
                    await resp.read()
                    status = resp.status
            except aiohttp.ClientConnectionError:
                status = 0  # connection lost (the soak kills routers): reported, not a 5xx
            except (aiohttp.ClientError, OSError, TimeoutError):
                status = None
            out.append((t, kind, status))
    return out
