"""Injected time: every decision takes `now` from a Clock, never from the OS directly.

`monotonic()` measures intervals (deadlines, lease expiry); `wall()` stamps documents
(handoff `written_at`, hold deadlines that must survive a restart); `sleep()` is how a
background loop waits for its next turn, so that a scenario test can run the loop in
virtual time (`FakeClock.run_for`) instead of waiting real seconds.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(order=True, slots=True)
class _Sleeper:
    deadline: float
    seq: int  # equal deadlines wake in the order they went to sleep
    future: asyncio.Future[None] = field(compare=False)


class FakeClock:
    """A clock that only moves when a test says so.

    `sleep` parks the caller until `advance` moves monotonic time to its deadline; `advance`
    is synchronous and only wakes the due sleepers (in deadline order), so their tasks run
    at the test's next await. `run_for` is the scenario driver: it jumps from deadline to
    deadline and lets the woken tasks run until the loop is quiet again (`settle`).
    """

    QUIET_TURNS = 3
    """Event-loop turns without activity after which `settle` calls the loop quiet."""
    SETTLE_ROUNDS = 10_000
    """Turns `settle` allows before it calls the tasks busy (a loop that never waits)."""

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_800_000_000.0) -> None:
        self._mono = monotonic
        self._wall = wall
        self._sleepers: list[_Sleeper] = []
        self._seq = itertools.count()
        self._activity = 0  # sleeps started, sleepers woken: what `settle` watches

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never goes back")
        self._move_to(self._mono + seconds)

    def _move_to(self, mono: float) -> None:
        self._wall += mono - self._mono
        self._mono = mono
        while self._sleepers and self._sleepers[0].deadline <= self._mono:
            sleeper = heapq.heappop(self._sleepers)
            if not sleeper.future.done():  # done: its task was cancelled while asleep
                sleeper.future.set_result(None)
                self._activity += 1

    async def sleep(self, seconds: float) -> None:
        """Wait until monotonic time reaches now + `seconds`; 0 or less yields once, as
        `asyncio.sleep(0)` does, so a loop that is behind schedule still lets others run."""
        self._activity += 1
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sleeper = _Sleeper(self._mono + seconds, next(self._seq), future)
        heapq.heappush(self._sleepers, sleeper)
        await future

    def next_deadline(self) -> float | None:
        """The earliest monotonic time a sleeper waits for, or None when nobody sleeps."""
        pending = [s.deadline for s in self._sleepers if not s.future.done()]
        return min(pending, default=None)

    async def settle(self) -> None:
        """Yield to the event loop until the tasks it runs are all waiting again.

        Quiet means `QUIET_TURNS` turns in a row in which no task started or ended and no
        sleep on this clock started or ended: the woken loops are asleep again, and so is
        every task they started. (Progress that touches neither, such as a chain of more
        than `QUIET_TURNS` events set task to task, would be cut short; a task waiting on
        real I/O is simply left waiting.) A task that never waits, a `sleep(0)` busy loop,
        raises RuntimeError after `SETTLE_ROUNDS` turns instead of hanging the test.
        """
        me = asyncio.current_task()
        seen: tuple[int, set[asyncio.Task[Any]]] | None = None
        quiet = 0
        for _ in range(self.SETTLE_ROUNDS):
            await asyncio.sleep(0)
            state = (self._activity, {t for t in asyncio.all_tasks() if t is not me})
            quiet = quiet + 1 if state == seen else 0
            if quiet >= self.QUIET_TURNS:
                return
            seen = state
        raise RuntimeError(f"tasks on the fake clock still busy after {self.SETTLE_ROUNDS} turns")

    async def run_for(self, seconds: float) -> None:
        """Run the loops sleeping on this clock through `seconds` of virtual time.

        Time jumps to each sleeper's deadline in turn (so a woken loop sees `monotonic()`
        equal to its deadline) and the woken tasks run until they are parked again; then
        time moves to the end of the span.
        """
        if seconds < 0:
            raise ValueError("a clock never goes back")
        end = self._mono + seconds
        await self.settle()
        while (deadline := self.next_deadline()) is not None and deadline <= end:
            self._move_to(deadline)
            await self.settle()
        self._move_to(end)
        await self.settle()
