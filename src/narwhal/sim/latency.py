"""The latency model: TTFT per prompt token, inter-token latency, KV transfer per block.

Pure arithmetic; the waiting goes through an injected `Sleeper`, so tests can replace time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Sleeper = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class LatencyModel:
    ttft_per_token_ms: float
    itl_ms: float
    transfer_per_block_ms: float

    def ttft_s(self, prompt_tokens: int, factor: float = 1.0) -> float:
        return self.ttft_per_token_ms * prompt_tokens * factor / 1000.0

    def itl_s(self, factor: float = 1.0) -> float:
        return self.itl_ms * factor / 1000.0

    def transfer_s(self, blocks: int, factor: float = 1.0) -> float:
        return self.transfer_per_block_ms * blocks * factor / 1000.0


async def pause(sleeper: Sleeper, seconds: float | None) -> None:
    """Wait `seconds` through `sleeper`; `None` waits until cancelled, zero does not yield."""
    if seconds is None:
        await asyncio.Event().wait()
    elif seconds > 0:
        await sleeper(seconds)
