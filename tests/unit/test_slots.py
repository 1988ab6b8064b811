"""The per-engine slot pool: first free slot, waiters served in order, no slot lost."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.engine.slots import MIN_SHARED_CHARS, SlotPool, shared_prefix


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


async def test_a_prompt_gets_the_free_slot_holding_its_longest_prefix() -> None:
    """llama-server reuses a slot's KV only in that slot: the slot whose last prompt shares
    the longest prefix (of at least MIN_SHARED_CHARS) with the new one is handed out."""
    pool = SlotPool(3)
    alpha, beta = "A" * 200 + " first", "B" * 200 + " first"
    for content in (alpha, beta, None):
        pool.release(await pool.acquire(1.0, content))  # slots 0, 1, 2 in turn
    assert await pool.acquire(1.0, "B" * 200 + " second") == 1
    assert await pool.acquire(1.0, "A" * 200 + " second") == 0


async def test_without_a_long_enough_shared_prefix_the_least_recently_used_slot() -> None:
    pool = SlotPool(2)
    pool.release(await pool.acquire(1.0, "x" * (MIN_SHARED_CHARS - 1) + "1"))  # slot 0
    pool.release(await pool.acquire(1.0, "y" * 100))  # slot 1
    # slot 0 shares only MIN_SHARED_CHARS - 1 characters: not a reuse, LRU order stands
    assert await pool.acquire(1.0, "x" * (MIN_SHARED_CHARS - 1) + "2") == 0


async def test_a_restore_forgets_what_the_slot_held() -> None:
    pool = SlotPool(2)
    pool.release(await pool.acquire(1.0, "A" * 200))  # slot 0 holds A
    pool.release(await pool.acquire(1.0, None))  # slot 1: a restore
    pool.release(await pool.acquire(1.0, None))  # slot 0 restored over: A is gone
    assert await pool.acquire(1.0, "A" * 200 + "more") == 1  # LRU: nothing holds A


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [("", "", 0), ("abc", "", 0), ("abc", "abd", 2), ("abc", "abc", 3), ("ab", "abc", 2)],
)
def test_shared_prefix(a: str, b: str, n: int) -> None:
    assert shared_prefix(a, b) == n == shared_prefix(b, a)
