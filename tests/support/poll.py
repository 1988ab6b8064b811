"""Polling with a deadline: end-to-end tests wait for states this way, never by sleeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import aiohttp

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T]] | Callable[[], T],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str = "condition",
) -> T:
    """Call `probe` until it returns a truthy value; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        result = probe()
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result  # type: ignore[misc]
        if result:
            return result  # type: ignore[return-value]
        last = result
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout_s}s waiting for {what} (last: {last!r})"
            )
        await asyncio.sleep(interval_s)


async def until_ready(
    url: str, proc: asyncio.subprocess.Process, log: Path, *, timeout_s: float, what: str
) -> None:
    """Poll `url` (a `/ready`) until it answers 200; fail at once, with the log, if the
    process serving it exited."""
    async with aiohttp.ClientSession() as http:

        async def ready() -> bool:
            if proc.returncode is not None:
                raise AssertionError(await asyncio.to_thread(log.read_text))
            try:
                async with http.get(url) as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await eventually(ready, timeout_s=timeout_s, interval_s=0.1, what=what)
