"""Per-engine slot allocation for engines that serve a request in a numbered slot.

llama.cpp's `llama-server --parallel N` has N slots; a KV handoff saves one slot and restores
into another, so the router must know which slot each leg owns. Slots are handed out
first-free, waiters are served in order, and the size can grow once the engine reports it.
"""

from __future__ import annotations

import asyncio
from collections import deque


class SlotPool:
    def __init__(self, size: int = 1) -> None:
        self.size = size
        self._free: deque[int] = deque(range(size))
        self._waiters: deque[asyncio.Future[int]] = deque()

    @property
    def busy(self) -> int:
        return self.size - len(self._free)

    def resize(self, size: int) -> None:
        """Grow to `size` slots (never shrinks: a busy slot cannot be taken back)."""
        for slot in range(self.size, size):
            self.size += 1
            self._give(slot)

    async def acquire(self, timeout_s: float) -> int:
        """A free slot number; TimeoutError when none comes free within `timeout_s`."""
        if self._free and not self._waiters:
            return self._free.popleft()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._give(fut.result())  # handed to us just as we gave up
            else:
                fut.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self, slot: int) -> None:
        self._give(slot)

    def _give(self, slot: int) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self._free.append(slot)
