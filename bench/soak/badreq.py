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
# Kinds only the engines can judge (the prompt's token count): a router that is not admitting
# answers them 503 like any request, which is its state, not the client's error.
ENGINE_JUDGED = frozenset({"prompt_too_long", "prompt_too_long_stream"})

BadAnswer = tuple[float, str, int | None, str]
"""(t, kind, status, error message) of one bad request."""


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
) -> list[BadAnswer]:
    """One bad request every `every_s` until `until` (monotonic): (t, kind, status, error
    message), status 0 for a lost connection, None for no answer in time."""
    kinds = bodies(model)
    names = sorted(kinds)
    out: list[BadAnswer] = []
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
            message = ""
            try:
                async with session.post(
                    base + "/v1/completions", data=kinds[kind], headers=headers
                ) as resp:
                    message = error_message(await resp.read())
                    status = resp.status
            except aiohttp.ClientConnectionError:
                status = 0  # connection lost (the soak kills routers): reported, not a 5xx
            except (aiohttp.ClientError, OSError, TimeoutError):
                status = None
            out.append((t, kind, status, message))
    return out


def error_message(body: bytes) -> str:
    """The OpenAI error shape's message, or "" for any other body."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return message if isinstance(message, str) else ""
