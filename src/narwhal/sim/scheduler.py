"""The engine's running and waiting queues, as vLLM's scheduler keeps them.

A request runs once a sequence slot is free (`max_num_seqs`, None: unlimited) and its admission
succeeds (its KV blocks fit beside the running requests'); until then it waits, first come
first served: a request never overtakes an earlier one. A waiter that leaves (its client went
away) gives its turn up, and anything it was admitted with is released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _Waiter(Generic[T]):
    admit: Callable[[], T | None]
    release: Callable[[T], None]
    admitted: asyncio.Future[T]


class Scheduler:
    def __init__(self, max_num_seqs: int | None) -> None:
        self._max_num_seqs = max_num_seqs
        self._waiters: deque[_Waiter[object]] = deque()
        self.running = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(
        self, admit: Callable[[], T | None], release: Callable[[T], None]
    ) -> AsyncIterator[T]:
        """Hold a running slot (waiting in line for it) and what `admit` returned for it;
        `admit` answers None while the request cannot run yet."""
        admitted: T | None = None
        if not self._waiters and self._slot_free():
            admitted = admit()
        if admitted is None:
            admitted = await self._wait(admit, release)
        else:
            self.running += 1
        try:
            yield admitted
        finally:
            self.running -= 1
            release(admitted)
            self._dispatch()

    async def _wait(self, admit: Callable[[], T | None], release: Callable[[T], None]) -> T:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(admit, release, future)
        self._waiters.append(waiter)  # type: ignore[arg-type]
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.running -= 1  # admitted just as it left
                release(future.result())
            else:
                future.cancel()
                self._waiters.remove(waiter)  # type: ignore[arg-type]
            self._dispatch()
            raise

    def _slot_free(self) -> bool:
        return self._max_num_seqs is None or self.running < self._max_num_seqs

    def _dispatch(self) -> None:
        """Admit waiters in order while the head can run."""
        while self._waiters and self._slot_free():
            head = self._waiters[0]
            admitted = head.admit()
            if admitted is None:
                return
            self._waiters.popleft()
            self.running += 1
            head.admitted.set_result(admitted)
