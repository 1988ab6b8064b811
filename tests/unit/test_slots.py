"""The per-engine slot pool: first free slot, waiters served in order, no slot lost."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.engine.slots import SlotPool


async def test_hands_out_distinct_slots_and_takes_them_back() -> None:
    pool = SlotPool(2)
    a = await pool.acquire(1.0)
    b = await pool.acquire(1.0)
    assert {a, b} == {0, 1}
    assert pool.busy == 2
    pool.release(a)
    assert await pool.acquire(1.0) == a


async def test_a_full_pool_times_out_and_keeps_every_slot() -> None:
    pool = SlotPool(1)
    slot = await pool.acquire(1.0)
    with pytest.raises(TimeoutError):
        await pool.acquire(0.01)
    pool.release(slot)
    assert pool.busy == 0
    assert await pool.acquire(0.01) == slot


async def test_waiters_are_served_in_order() -> None:
    pool = SlotPool(1)
    held = await pool.acquire(1.0)
    order: list[str] = []

    async def wait(name: str) -> None:
        slot = await pool.acquire(5.0)
        order.append(name)
        pool.release(slot)

    first = asyncio.create_task(wait("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    pool.release(held)
    await asyncio.gather(first, second)
    assert order == ["first", "second"]
    assert pool.busy == 0


async def test_a_cancelled_waiter_does_not_swallow_a_slot() -> None:
    pool = SlotPool(1)
    held = await pool.acquire(1.0)
    waiter = asyncio.create_task(pool.acquire(5.0))
    await asyncio.sleep(0)
    pool.release(held)  # handed to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.busy == 0
    assert await pool.acquire(0.01) == held


async def test_resize_grows_and_wakes_waiters() -> None:
    pool = SlotPool(1)
    await pool.acquire(1.0)
    waiter = asyncio.create_task(pool.acquire(5.0))
    await asyncio.sleep(0)
    pool.resize(3)
    assert await waiter == 1
    assert pool.size == 3
    assert await pool.acquire(0.01) == 2
    pool.resize(2)  # never shrinks
    assert pool.size == 3
