"""The data pool's bound shared by worker processes (`SharedBudget` over the memfd table).

Two mappings of one memfd stand for two workers: units taken by either count against the
one limit, a unit given back by one is taken by the other, and a waiter in one pool gets a
unit freed by the other pool (which cannot wake it: it looks again).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from narwhal.dataplane.pool import Pool, PoolExhausted
from narwhal.process.table import POOL_IN_USE, SharedBudget, WorkerTable

LIMIT = 3


@pytest.fixture
def tables() -> Iterator[tuple[WorkerTable, WorkerTable]]:
    first = WorkerTable.create(2)
    second = WorkerTable(os.dup(first.fd), 2)
    try:
        yield first, second
    finally:
        first.close()
        second.close()


def test_units_taken_by_either_worker_count_against_one_limit(
    tables: tuple[WorkerTable, WorkerTable],
) -> None:
    a = SharedBudget(tables[0], 0, LIMIT)
    b = SharedBudget(tables[1], 1, LIMIT)
    assert [a.take(), b.take(), a.take()] == [True, True, True]
    assert not b.take() and not a.take()
    assert tables[0].total(POOL_IN_USE) == LIMIT
    a.give_back()
    assert b.take()
    assert (tables[0].get(0, POOL_IN_USE), tables[0].get(1, POOL_IN_USE)) == (1, 2)


async def test_a_waiter_gets_a_unit_another_worker_frees(
    tables: tuple[WorkerTable, WorkerTable],
) -> None:
    pool_a = Pool("data", LIMIT, shared=SharedBudget(tables[0], 0, LIMIT))
    pool_b = Pool("data", LIMIT, shared=SharedBudget(tables[1], 1, LIMIT))
    for _ in range(LIMIT):
        assert pool_b.try_acquire()
    assert not pool_a.try_acquire()  # worker A has nothing in use, but the router is full
    waiting = asyncio.create_task(pool_a.acquire(5.0, queue_limit=1))
    await asyncio.sleep(0)
    assert pool_a.waiting == 1 and not waiting.done()
    pool_b.release()
    await asyncio.wait_for(waiting, 5.0)
    assert pool_a.in_use == 1 and pool_a.waiting == 0
    assert tables[0].total(POOL_IN_USE) == LIMIT


async def test_a_waiter_still_times_out_when_nothing_is_freed(
    tables: tuple[WorkerTable, WorkerTable],
) -> None:
    pool_a = Pool("data", LIMIT, shared=SharedBudget(tables[0], 0, LIMIT))
    pool_b = Pool("data", LIMIT, shared=SharedBudget(tables[1], 1, LIMIT))
    for _ in range(LIMIT):
        assert pool_b.try_acquire()
    with pytest.raises(PoolExhausted):
        await pool_a.acquire(0.05, queue_limit=1)
    assert pool_a.waiting == 0 and pool_a.in_use == 0
    assert tables[0].total(POOL_IN_USE) == LIMIT
