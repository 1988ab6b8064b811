"""Batched prompts and `n > 1` run as parts (issue 20 §3): `fanout.py` splits the request and
merges the answers (pure); this module serves the parts, each through the serving policy as
any request is, a few at a time.

A part in flight holds a data connection: the request's own, plus up to `fanout.PARALLEL - 1`
more that are free now (none: the parts take turns on one). The first part that fails (in
order) is the answer and the rest are cancelled: the client asked for all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from narwhal.dataplane.exchange import Answer, Exchange, Result
from narwhal.dataplane.fanout import PARALLEL, merge, split
from narwhal.dataplane.requests import ClientRequest

Serve = Callable[[ClientRequest, Exchange, float], Awaitable[Result]]
"""One request through the serving policy (`DataPlane._serve`)."""


class Connections(Protocol):
    """The data pool's part the fan-out uses (`Pool`)."""

    def try_acquire(self) -> bool: ...

    def release(self) -> None: ...


class _PartFailed(Exception):
    """A part was not answered 200 (its answer is the request's)."""


class FanOut:
    def __init__(self, pool: Connections, serve: Serve) -> None:
        self._pool = pool
        self._serve = serve

    async def answer(self, req: ClientRequest, exchange: Exchange, deadline: float) -> Answer:
        """The parts' answers merged in choice order, or the first failed part's answer.
        The caller holds the request's own data connection."""
        parts = split(req)
        answers: list[bytes] = [b""] * len(parts)
        failures: list[tuple[int, Answer]] = []
        extra = 0
        while extra < min(PARALLEL, len(parts)) - 1 and self._pool.try_acquire():
            extra += 1
        turns = asyncio.Semaphore(1 + extra)

        async def serve(index: int, part: ClientRequest) -> None:
            async with turns:
                result = await self._serve(part, exchange, deadline)
            assert isinstance(result, Answer)  # parts are never streamed
            if result.status != 200:
                failures.append((index, result))
                raise _PartFailed()  # cancels the other parts
            answers[index] = result.body

        try:
            async with asyncio.TaskGroup() as group:
                for index, part in enumerate(parts):
                    group.create_task(serve(index, part))
        except* _PartFailed:
            pass  # `failures` says which
        finally:
            for _ in range(extra):
                self._pool.release()
        if failures:
            return min(failures, key=lambda f: f[0])[1]
        return Answer(200, merge(answers, req.n), "application/json")
