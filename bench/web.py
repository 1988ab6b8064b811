"""Small HTTP helpers for the orchestrator (not the load path): JSON calls and readiness polls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp

_TIMEOUT = aiohttp.ClientTimeout(total=10)


async def call(method: str, url: str, body: Any = None, timeout_s: float = 10.0) -> tuple[int, Any]:
    """One request on a fresh connection; returns (status, parsed JSON or text)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.request(method, url, json=body) as resp,
    ):
        text = await resp.text()
        if resp.content_type == "application/json" and text:
            return resp.status, await resp.json(content_type=None)
        return resp.status, text


async def wait_until(
    url: str,
    ok: tuple[int, ...] = (200,),
    timeout_s: float = 60.0,
    alive: Callable[[], bool] = lambda: True,
) -> None:
    """Poll GET `url` until it answers one of `ok` (fail early once `alive()` is false)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{url}: the process exited ({last})")
        try:
            status, body = await call("GET", url, timeout_s=2.0)
            if status in ok:
                return
            last = f"HTTP {status}: {str(body)[:200]}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout_s} s ({last})")


async def histogram(url: str, name: str) -> list[tuple[float, float]]:
    """One Prometheus histogram's cumulative buckets `(le, count)`, summed over label sets,
    in order ([] when it has no samples)."""
    status, text = await call("GET", url)
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}")
    buckets: dict[float, float] = {}
    prefix = name + "_bucket{"
    for line in str(text).splitlines():
        if line.startswith(prefix):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return sorted(buckets.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` (None: no samples)."""
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return None
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return buckets[-1][0]


async def metric(url: str, name: str) -> float:
    """Sum of every sample of one Prometheus metric (all label sets)."""
    status, text = await call("GET", url)
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}")
    total = 0.0
    for line in str(text).splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
