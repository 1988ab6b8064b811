"""The connection gate (DESIGN §1, "Connection pools"): a hard bound with a bounded FIFO queue.

No test sleeps to wait for a state: tasks are driven with events, and `_until`/`_spin` only yield to
the loop (zero-length sleeps) until a predicate holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.dataplane.pool import Pool, PoolExhausted

LONG = 60.0  # a timeout that never fires within a test


async def _spin(times: int = 20) -> None:
    """Let every runnable task take `times` steps (zero-length sleeps only)."""
    for _ in range(times):
        await asyncio.sleep(0)


async def _until(predicate: Callable[[], bool], spins: int = 50) -> None:
    """Yield to the loop until `predicate` holds."""
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0)
    assert predicate(), "state not reached"


def _full(limit: int = 1) -> Pool:
    pool = Pool("data", limit)
    for _ in range(limit):
        assert pool.try_acquire()
    return pool


async def _enqueue(
    pool: Pool, queue_limit: int = 10, timeout_s: float = LONG
) -> asyncio.Task[None]:
    expected = pool.waiting + 1
    task = asyncio.create_task(pool.acquire(timeout_s, queue_limit))
    await _until(lambda: pool.waiting == expected)
    return task


# --------------------------------------------------------------------------- basics


def test_try_acquire_respects_the_bound() -> None:
    pool = Pool("data", 2)
    assert (pool.in_use, pool.waiting) == (0, 0)
    assert pool.try_acquire()
    assert pool.try_acquire()
    assert not pool.try_acquire()
    assert pool.in_use == 2
    pool.release()
    assert pool.in_use == 1
    assert pool.try_acquire()
    assert pool.in_use == 2


async def test_acquire_free_slot_does_not_queue() -> None:
    pool = Pool("data", 1)
    await pool.acquire(LONG, 0)
    assert (pool.in_use, pool.waiting) == (1, 0)


async def test_zero_limit_pool_rejects() -> None:
    pool = Pool("data", 0)
    assert not pool.try_acquire()
    with pytest.raises(PoolExhausted):
        await pool.acquire(0, 10)


async def test_bound_never_exceeded_under_contention() -> None:
    limit, workers = 3, 20
    pool = Pool("data", limit)
    gates = [asyncio.Event() for _ in range(workers)]
    holding: set[int] = set()
    peak = 0

    async def worker(i: int) -> None:
        nonlocal peak
        await pool.acquire(LONG, workers)
        holding.add(i)
        peak = max(peak, len(holding))
        assert pool.in_use <= limit
        await gates[i].wait()
        holding.discard(i)
        pool.release()

    tasks = [asyncio.create_task(worker(i)) for i in range(workers)]
    await _until(lambda: len(holding) == limit and pool.waiting == workers - limit)
    for gate in gates:
        gate.set()
        await _spin(3)
        assert pool.in_use <= limit
    await asyncio.gather(*tasks)
    assert peak == limit
    assert (pool.in_use, pool.waiting) == (0, 0)


# --------------------------------------------------------------------------- FIFO hand-over


async def test_fifo_hand_over() -> None:
    pool = _full(1)
    order: list[int] = []
    done = [asyncio.Event() for _ in range(3)]

    async def waiter(i: int) -> None:
        await pool.acquire(LONG, 10)
        order.append(i)
        await done[i].wait()
        pool.release()

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(waiter(i)))
        await _until(lambda i=i: pool.waiting == i + 1)

    pool.release()  # hand over to waiter 0: the slot never becomes free
    assert (pool.in_use, pool.waiting) == (1, 2)
    assert not pool.try_acquire(), "a newcomer must not overtake the queue"
    await _until(lambda: order == [0])
    for i in range(3):
        done[i].set()
        await tasks[i]
        await _until(lambda i=i: order == list(range(min(i + 2, 3))))
    assert order == [0, 1, 2]
    assert (pool.in_use, pool.waiting) == (0, 0)


async def test_newcomer_queues_behind_waiters() -> None:
    pool = _full(1)
    first = await _enqueue(pool)
    second = await _enqueue(pool)
    pool.release()
    await first
    assert not second.done()
    assert pool.in_use == 1
    pool.release()
    await second
    pool.release()
    assert (pool.in_use, pool.waiting) == (0, 0)


# --------------------------------------------------------------------------- exhaustion


async def test_queue_limit_raises_pool_exhausted() -> None:
    pool = _full(1)
    queued = [await _enqueue(pool, queue_limit=2), await _enqueue(pool, queue_limit=2)]
    with pytest.raises(PoolExhausted):
        await pool.acquire(LONG, 2)
    assert (pool.in_use, pool.waiting) == (1, 2)
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    assert (pool.in_use, pool.waiting) == (1, 0)


async def test_queue_limit_zero_never_waits() -> None:
    pool = _full(1)
    with pytest.raises(PoolExhausted, match="data pool exhausted"):
        await pool.acquire(LONG, 0)
    assert (pool.in_use, pool.waiting) == (1, 0)


@pytest.mark.parametrize("timeout_s", [0.0, -1.0], ids=["zero", "negative"])
async def test_no_time_to_wait_raises_at_once(timeout_s: float) -> None:
    pool = _full(1)
    with pytest.raises(PoolExhausted):
        await pool.acquire(timeout_s, 10)
    assert (pool.in_use, pool.waiting) == (1, 0)


async def test_timeout_raises_pool_exhausted_and_leaves_no_waiter() -> None:
    pool = _full(1)
    with pytest.raises(PoolExhausted):
        await pool.acquire(0.001, 10)
    assert (pool.in_use, pool.waiting) == (1, 0)
    pool.release()
    assert pool.in_use == 0, "the timed-out waiter must not receive the slot"


async def test_timed_out_waiter_is_skipped_by_hand_over() -> None:
    pool = _full(1)
    patient = await _enqueue(pool)
    with pytest.raises(PoolExhausted):
        await pool.acquire(0.001, 10)
    assert pool.waiting == 1
    pool.release()
    await patient
    assert (pool.in_use, pool.waiting) == (1, 0)


# --------------------------------------------------------------------------- cancellation


async def test_cancelled_waiter_does_not_leak() -> None:
    pool = _full(1)
    task = await _enqueue(pool)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (pool.in_use, pool.waiting) == (1, 0)
    pool.release()
    assert (pool.in_use, pool.waiting) == (0, 0)


async def test_release_right_after_cancel_skips_the_cancelled_waiter() -> None:
    pool = _full(1)
    task = await _enqueue(pool)
    task.cancel()  # the waiter has not run its cleanup yet
    pool.release()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (pool.in_use, pool.waiting) == (0, 0)


async def test_slot_handed_over_as_waiter_is_cancelled_is_returned() -> None:
    pool = _full(1)
    task = await _enqueue(pool)
    pool.release()  # hand the slot to the waiter ...
    task.cancel()  # ... which is cancelled before it could run
    assert (pool.in_use, pool.waiting) == (1, 0)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (pool.in_use, pool.waiting) == (0, 0)
    assert pool.try_acquire()


async def test_slot_handed_over_as_waiter_is_cancelled_passes_to_next_waiter() -> None:
    pool = _full(1)
    first = await _enqueue(pool)
    second = await _enqueue(pool)
    pool.release()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert (pool.in_use, pool.waiting) == (1, 0)
    pool.release()
    assert (pool.in_use, pool.waiting) == (0, 0)


async def test_slot_handed_over_as_waiter_times_out_is_not_leaked() -> None:
    """The deadline fires in the same loop iteration as the hand-over.

    A 1 ns deadline is already past when the waiter arms it, so asyncio queues the timeout
    callback at once; the release below runs before that callback, so the waiter is woken with
    a result *and* a cancellation. Whichever way that resolves, no slot may leak.
    """
    pool = _full(1)
    task = asyncio.create_task(pool.acquire(1e-9, 10))
    await asyncio.sleep(0)  # the waiter queues and arms its (already expired) deadline
    assert pool.waiting == 1
    pool.release()
    try:
        await task
    except PoolExhausted:
        assert (pool.in_use, pool.waiting) == (0, 0)
    else:
        assert (pool.in_use, pool.waiting) == (1, 0)
        pool.release()
    assert pool.in_use == 0


async def test_holder_cancelled_after_hand_over_keeps_the_count_right() -> None:
    pool = _full(2)
    a = await _enqueue(pool)
    b = await _enqueue(pool)
    pool.release()
    pool.release()  # both waiters are handed a slot ...
    a.cancel()
    b.cancel()  # ... and both are cancelled before running
    await asyncio.gather(a, b, return_exceptions=True)
    assert (pool.in_use, pool.waiting) == (0, 0)


# --------------------------------------------------------------------------- random interleavings

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("spawn"), st.sampled_from([0.0, LONG]), st.integers(0, 3)),
        st.tuples(st.just("finish"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("cancel"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("yield"), st.just(0.0), st.just(0)),
    ),
    max_size=40,
)


async def _interleave(limit: int, ops: list[tuple[str, float | int, int]]) -> None:
    pool = Pool("data", limit)
    holding: set[int] = set()
    gates: list[asyncio.Event] = []
    tasks: list[asyncio.Task[None]] = []

    async def worker(i: int, timeout_s: float, queue_limit: int) -> None:
        try:
            await pool.acquire(timeout_s, queue_limit)
        except PoolExhausted:
            return
        holding.add(i)
        try:
            await gates[i].wait()
        finally:
            holding.discard(i)
            pool.release()

    def check() -> None:
        assert 0 <= pool.in_use <= limit
        assert len(holding) <= pool.in_use

    for op, a, b in ops:
        if op == "spawn":
            gates.append(asyncio.Event())
            tasks.append(asyncio.create_task(worker(len(tasks), float(a), b)))
        elif op == "finish" and tasks:
            gates[int(a) % len(gates)].set()
        elif op == "cancel" and tasks:
            tasks[int(a) % len(tasks)].cancel()
        else:
            await asyncio.sleep(0)
        check()

    await _spin()
    check()
    assert pool.in_use == len(holding), "a slot is held by nobody"
    if pool.in_use < limit:
        assert pool.waiting == 0, "a free slot while someone waits"

    for gate in gates:
        gate.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert (pool.in_use, pool.waiting) == (0, 0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), _ops)
def test_random_interleavings_never_leak(
    limit: int, ops: list[tuple[str, float | int, int]]
) -> None:
    asyncio.run(_interleave(limit, ops))
