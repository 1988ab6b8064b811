"""The fake clock's virtual time: sleepers wake at their deadline, in deadline order, and
only when the test moves time; `run_for` hands each woken task its turn before moving on."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.clock import FakeClock

T0 = 1000.0


async def test_a_sleeper_wakes_only_when_time_reaches_its_deadline() -> None:
    clock = FakeClock(monotonic=T0)
    woke: list[float] = []

    async def nap() -> None:
        await clock.sleep(5.0)
        woke.append(clock.monotonic())

    task = asyncio.create_task(nap())
    await clock.settle()
    assert clock.next_deadline() == T0 + 5.0
    clock.advance(4.999)
    await clock.settle()
    assert woke == []
    clock.advance(0.001)
    await clock.settle()
    assert woke == [pytest.approx(T0 + 5.0)]
    assert task.done() and clock.next_deadline() is None


async def test_sleepers_wake_in_deadline_order_then_in_the_order_they_slept() -> None:
    clock = FakeClock(monotonic=T0)
    order: list[str] = []

    async def nap(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        order.append(name)

    naps = [
        asyncio.create_task(nap(name, seconds))
        for name, seconds in (("c", 3.0), ("a", 1.0), ("b1", 2.0), ("b2", 2.0))
    ]
    await clock.settle()
    clock.advance(10.0)  # one jump past every deadline
    await clock.settle()
    assert order == ["a", "b1", "b2", "c"]
    assert all(t.done() for t in naps)


async def test_run_for_wakes_each_sleeper_at_its_deadline() -> None:
    clock = FakeClock(monotonic=T0)
    ticks: list[float] = []

    async def every(interval_s: float) -> None:
        while True:
            ticks.append(clock.monotonic())
            await clock.sleep(interval_s)

    task = asyncio.create_task(every(2.5))
    await clock.run_for(10.0)
    assert ticks == [T0, T0 + 2.5, T0 + 5.0, T0 + 7.5, T0 + 10.0]
    assert clock.monotonic() == T0 + 10.0
    assert clock.wall() == 1_800_000_000.0 + 10.0  # wall time moves with it
    task.cancel()


async def test_run_for_runs_tasks_the_woken_ones_start() -> None:
    """A task started by a woken loop runs (and parks) before time moves on."""
    clock = FakeClock(monotonic=T0)
    seen: list[tuple[str, float]] = []

    async def child() -> None:
        seen.append(("child", clock.monotonic()))
        await clock.sleep(100.0)

    async def parent() -> None:
        await clock.sleep(1.0)
        await asyncio.create_task(child())

    task = asyncio.create_task(parent())
    await clock.run_for(5.0)
    assert seen == [("child", T0 + 1.0)]
    task.cancel()


async def test_sleep_zero_yields_without_parking() -> None:
    clock = FakeClock()
    await clock.sleep(0)
    await clock.sleep(-1.0)
    assert clock.next_deadline() is None


async def test_a_cancelled_sleeper_is_never_woken() -> None:
    clock = FakeClock(monotonic=T0)
    task = asyncio.create_task(clock.sleep(1.0))
    await clock.settle()
    task.cancel()
    await clock.settle()
    assert clock.next_deadline() is None
    clock.advance(2.0)  # the cancelled sleeper's future is skipped, not resolved
    assert task.cancelled()


async def test_settle_refuses_a_loop_that_never_waits() -> None:
    """A `sleep(0)` busy loop fails the test instead of hanging it."""
    clock = FakeClock()
    clock.SETTLE_ROUNDS = 50

    async def busy() -> None:
        while True:
            await clock.sleep(0)

    task = asyncio.create_task(busy())
    with pytest.raises(RuntimeError, match="still busy"):
        await clock.settle()
    task.cancel()


async def test_time_never_goes_back() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError):
        clock.advance(-1.0)
    with pytest.raises(ValueError):
        await clock.run_for(-1.0)
