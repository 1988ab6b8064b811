"""A hard bound on connections in use, with an optional bounded wait queue.

The aiohttp connector holds the sockets; this gate decides who may use one, so saturation
is visible (503) instead of an unbounded wait inside the HTTP client. With data-plane worker
processes the bound is the router's, not the process's: every unit in use is also taken from
a `Budget` the workers share.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol


class PoolExhausted(Exception):
    """No connection free (and no room or time to wait for one)."""


class Budget(Protocol):
    """Units shared with other processes: one per connection in use, across all of them."""

    def take(self) -> bool:
        """One unit if the shared bound allows it now."""
        ...

    def give_back(self) -> None: ...


# A waiter for a shared budget looks again this often: another process that frees a unit
# cannot wake it.
SHARED_POLL_S = 0.005


class Pool:
    def __init__(
        self,
        name: str,
        limit: int,
        on_change: Callable[[Pool], None] | None = None,
        shared: Budget | None = None,
    ) -> None:
        self.name = name
        self.limit = limit
        self.in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        # Told after `waiting` moved: a worker mirrors it for the control process.
        self._on_change = on_change
        self._shared = shared

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        if self.in_use < self.limit and not self._waiters and self._take_shared():
            self.in_use += 1
            return True
        return False

    def _take_shared(self) -> bool:
        return self._shared is None or self._shared.take()

    async def acquire(self, timeout_s: float, queue_limit: int) -> None:
        """Take a slot, waiting at most `timeout_s` behind at most `queue_limit` others."""
        if self.try_acquire():
            return
        if len(self._waiters) >= queue_limit or timeout_s <= 0:
            raise PoolExhausted(f"{self.name} pool exhausted")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        if self._on_change is not None:
            self._on_change(self)
        try:
            async with asyncio.timeout(timeout_s):
                if self._shared is None:
                    await fut
                while not fut.done():  # a shared budget: look again for a unit freed elsewhere
                    await asyncio.wait({fut}, timeout=SHARED_POLL_S)
                    if (
                        not fut.done()
                        and self._waiters[0] is fut
                        and self.in_use < self.limit
                        and self._take_shared()
                    ):
                        self._waiters.popleft()
                        self.in_use += 1
                        fut.set_result(None)
                        if self._on_change is not None:
                            self._on_change(self)
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed to us just as we gave up
            else:
                fut.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)
            if self._on_change is not None:
                self._on_change(self)
            if isinstance(exc, TimeoutError):
                raise PoolExhausted(f"{self.name} pool exhausted") from None
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over: in_use stays the same
                if self._on_change is not None:
                    self._on_change(self)
                return
        self.in_use -= 1
        if self._shared is not None:
            self._shared.give_back()
