"""The scenario suite every lease store passes: `file` and a real `etcd` (DESIGN §5).

The same tests, parametrised over `FileLeaseStore` (a lease file under a real `flock`) and
`EtcdLeaseStore` (a real etcd server on loopback): compare-and-swap on the whole record
(a renewal between an acquirer's read and its swap makes the swap fail), renewal only by the
holder of the epoch, the epoch-guarded handoff write, and refusal of an older epoch's writes.
Backend-only behaviour (etcd outages, a stuck lock) is in the per-backend test files.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from narwhal.clock import FakeClock
from narwhal.config import LeaseConfig
from narwhal.state.etcd_store import EtcdLeaseStore
from narwhal.state.file_store import FileLeaseStore
from narwhal.state.lease import LeaseKeeper, LeaseRecord, LeaseStore, Role
from tests.support.etcd import EtcdServer

RACERS = 5
OVERLAPS = 20


def _record(holder: str, epoch: int, ttl_s: float = 10.0) -> LeaseRecord:
    return LeaseRecord(holder, epoch, time.time() + ttl_s)


@pytest.fixture(params=["file", "etcd"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LeaseStore]:
    s: LeaseStore
    if request.param == "file":
        s = FileLeaseStore(tmp_path / "lease.json", tmp_path / "handoff.json")
    else:
        etcd: EtcdServer = request.getfixturevalue("etcd_server")
        key = f"/narwhal-test/{uuid.uuid4().hex}/lease"
        s = EtcdLeaseStore((etcd.client_url,), key, timeout_s=2.0)
    yield s
    await s.close()


async def test_racing_acquirers_of_a_free_lease_one_wins(store: LeaseStore) -> None:
    assert await store.read() is None
    records = [_record(f"r{i}", 1) for i in range(RACERS)]
    won = await asyncio.gather(*(store.swap(None, r) for r in records))
    assert sorted(won) == [False] * (RACERS - 1) + [True]
    assert await store.read() == records[won.index(True)]


async def test_swap_compares_the_whole_record(store: LeaseStore) -> None:
    first = _record("router-a", 1)
    assert await store.swap(None, first)
    assert not await store.swap(None, _record("late", 1))  # expected none: there is one
    assert not await store.swap(LeaseRecord("router-a", 7, first.expires_at), _record("x", 8))
    # The holder renews between an acquirer's read (`first`) and its swap: same epoch, new
    # expiry. The stale swap must fail, or the acquirer would wait out the old expiry only.
    assert await store.renew("router-a", 1, first.expires_at + 5.0)
    renewed = await store.read()
    assert renewed == LeaseRecord("router-a", 1, first.expires_at + 5.0)
    assert not await store.swap(first, _record("router-b", 2))
    assert await store.read() == renewed
    nxt = _record("router-b", 2)
    assert await store.swap(renewed, nxt)
    assert await store.read() == nxt


async def test_only_the_holder_of_the_epoch_renews(store: LeaseStore) -> None:
    assert await store.swap(None, _record("router-a", 1))
    for holder, epoch in (("router-b", 1), ("router-a", 2), ("router-a", 0)):
        assert not await store.renew(holder, epoch, time.time() + 99)
    later = time.time() + 20
    assert await store.renew("router-a", 1, later)
    assert await store.read() == LeaseRecord("router-a", 1, later)


async def test_handoff_writes_are_guarded_by_the_epoch(store: LeaseStore) -> None:
    assert await store.read_handoff() is None
    assert not await store.write_handoff("router-a", 1, b"before any lease")
    first = _record("router-a", 1)
    assert await store.swap(None, first)
    assert await store.write_handoff("router-a", 1, b'{"by": "a1"}')
    assert await store.read_handoff() == b'{"by": "a1"}'
    assert await store.swap(first, _record("router-b", 2))  # b took over
    # The older epoch (and any other holder or epoch) is refused, and changes nothing.
    for holder, epoch in (("router-a", 1), ("router-a", 2), ("router-b", 1), ("router-b", 3)):
        assert not await store.write_handoff(holder, epoch, b'{"by": "stale"}')
        assert not await store.renew(holder, epoch, time.time() + 99)
    assert await store.read_handoff() == b'{"by": "a1"}'
    assert await store.write_handoff("router-b", 2, b'{"by": "b2"}')
    assert await store.read_handoff() == b'{"by": "b2"}'


async def test_a_restarted_holder_with_a_newer_epoch_refuses_the_old_process(
    store: LeaseStore,
) -> None:
    """Same router id, newer epoch: the old process's writes are refused all the same."""
    first = _record("router-a", 1)
    assert await store.swap(None, first)
    assert await store.swap(first, _record("router-a", 2))
    assert not await store.write_handoff("router-a", 1, b"old process")
    assert not await store.renew("router-a", 1, time.time() + 99)
    assert await store.write_handoff("router-a", 2, b"new process")
    assert await store.read_handoff() == b"new process"


async def test_the_holders_own_renewals_never_refuse_its_handoff_writes(
    store: LeaseStore,
) -> None:
    assert await store.swap(None, _record("router-a", 1))
    for i in range(OVERLAPS):
        written, renewed = await asyncio.gather(
            store.write_handoff("router-a", 1, str(i).encode()),
            store.renew("router-a", 1, time.time() + 10),
        )
        assert (written, renewed) == (True, True), i
    assert await store.read_handoff() == str(OVERLAPS - 1).encode()


async def test_two_keepers_over_the_store_preempt_and_fence(store: LeaseStore) -> None:
    """The keeper's rules over the real store: a preempted holder fences at its next renewal
    and its handoff writes are refused."""
    clock = FakeClock(wall=time.time())
    cfg = LeaseConfig.model_validate({"backend": "file", "ttl_s": 10, "renew_interval_s": 2})
    a = LeaseKeeper("router-a", cfg, store, clock)
    b = LeaseKeeper("router-b", cfg, store, clock)
    assert await a.try_acquire(preempt=False)
    assert await a.write_handoff(b"a")
    assert not await b.try_acquire(preempt=False)  # live: only a preemption takes it
    clock.advance(1.0)
    assert await b.try_acquire(preempt=True)
    assert (a.epoch, b.epoch) == (1, 2)
    assert b.admission_reason(clock.monotonic()) == "standby: waiting out the previous lease"
    await a.renew()
    assert a.role is Role.FENCED and a.fence_reason == "lease lost to router-b"
    assert not await a.write_handoff(b"a again")
    assert await b.write_handoff(b"b")
    assert await store.read_handoff() == b"b"
