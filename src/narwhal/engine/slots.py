"""Per-engine slot allocation for engines that serve a request in a numbered slot.

llama.cpp's `llama-server --parallel N` has N slots; a KV handoff saves one slot and restores
into another, so the router must know which slot each leg owns. Slots are handed out
least-recently-used first, waiters are served in order, and the size can grow once the engine
reports it.

A slot keeps the KV of the last prompt it evaluated, and llama-server reuses it for a next
prompt sharing its prefix (`cache_prompt`) only in that same slot. Since the router names the
slot (`id_slot`), it also decides the engine's cache hits: a leg that says what it will
evaluate (`content`) gets the free slot whose last content shares the longest prefix with it
(at least `MIN_SHARED_CHARS`), else the least recently used one. Cache-aware placement picks
the engine; this picks the slot within it (docs/placement.md, llama.cpp).
"""

from __future__ import annotations

import asyncio
from collections import deque

# Below this a shared prefix is a template's boilerplate, not a reused context.
MIN_SHARED_CHARS = 64


def shared_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b` (slices compared in C, a
    binary search: prompts run to hundreds of kilobytes)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class SlotPool:
    def __init__(self, size: int = 1) -> None:
        self.size = size
        self._free: deque[int] = deque(range(size))
        self._waiters: deque[asyncio.Future[int]] = deque()
        self._content: dict[int, str] = {}  # what each slot last evaluated, when told

    @property
    def busy(self) -> int:
        return self.size - len(self._free)

    def resize(self, size: int) -> None:
        """Grow to `size` slots (never shrinks: a busy slot cannot be taken back)."""
        for slot in range(self.size, size):
            self.size += 1
            self._give(slot)

    async def acquire(self, timeout_s: float, content: str | None = None) -> int:
        """A free slot number; TimeoutError when none comes free within `timeout_s`.
        `content`: what the leg will evaluate in it (its prompt), to reuse a slot that holds
        its prefix; None when the slot's KV is replaced whole (a restore)."""
        if self._free and not self._waiters:
            slot = self._pick(content)
        else:
            slot = await self._wait(timeout_s)
        if content is None:
            self._content.pop(slot, None)
        else:
            self._content[slot] = content
        return slot

    def _pick(self, content: str | None) -> int:
        free = self._free
        if content is None or len(free) == 1 or not self._content:
            return free.popleft()
        best, best_len = free[0], MIN_SHARED_CHARS - 1
        for slot in free:
            held = self._content.get(slot)
            if held is not None:
                n = shared_prefix(content, held)
                if n > best_len:
                    best, best_len = slot, n
        free.remove(best)
        return best

    async def _wait(self, timeout_s: float) -> int:
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
