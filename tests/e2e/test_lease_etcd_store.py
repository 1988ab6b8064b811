"""The `etcd` lease store against a real etcd server (v3 JSON gateway): etcd-only behaviour.

Outages reported as StoreUnavailable, the record surviving an etcd restart, and the handoff
guard never tripping on the holder's own renewals under many overlaps (the bug it had). The
scenarios every backend passes (swap, renew, the epoch guard) are in test_lease_stores.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from narwhal.clock import FakeClock
from narwhal.config import LeaseConfig
from narwhal.state.etcd_store import EtcdLeaseStore
from narwhal.state.lease import LeaseKeeper, LeaseRecord, Role, StoreUnavailable
from tests.support.etcd import EtcdServer
from tests.support.poll import eventually

OVERLAPS = 50  # one overlap loses about one time in four; 50 never all win by luck


def _record(holder: str, epoch: int, ttl_s: float = 10.0) -> LeaseRecord:
    return LeaseRecord(holder, epoch, time.time() + ttl_s)


@pytest.fixture
def key() -> str:
    return f"/narwhal-test/{uuid.uuid4().hex}/lease"


@pytest.fixture
async def store(etcd_server: EtcdServer, key: str) -> AsyncIterator[EtcdLeaseStore]:
    s = EtcdLeaseStore((etcd_server.client_url,), key, timeout_s=1.0)
    yield s
    await s.close()


async def test_the_record_and_the_handoff_live_at_the_documented_keys(
    store: EtcdLeaseStore, etcd_server: EtcdServer, key: str
) -> None:
    """docs/lease.md: the record at `lease.key`, the handoff at `<key>/handoff`, the owner
    that guards handoff writes at `<key>/owner`."""
    record = _record("router-a", 1)
    assert await store.swap(None, record)
    assert await store.write_handoff("router-a", 1, b'{"by": "a1"}')
    assert etcd_server.get_json(key) == record.to_json()
    assert etcd_server.get(key + "/handoff") == b'{"by": "a1"}'
    assert etcd_server.get(key + "/owner") == b"router-a:1"


async def test_an_unreachable_etcd_is_store_unavailable_and_the_record_survives(
    store: EtcdLeaseStore, etcd_server: EtcdServer
) -> None:
    assert await store.swap(None, _record("router-a", 1))
    etcd_server.stop()
    for call in (store.read(), store.renew("router-a", 1, time.time()), store.read_handoff()):
        with pytest.raises(StoreUnavailable, match="etcd unreachable"):
            await call
    etcd_server.start()  # same ports, same data dir

    async def readable() -> LeaseRecord | None:
        try:
            return await store.read()
        except StoreUnavailable:
            return None

    record = await eventually(readable, timeout_s=10, what="etcd back")
    assert (record.holder, record.epoch) == ("router-a", 1)


async def test_the_holders_own_renewal_does_not_refuse_its_handoff_write(
    store: EtcdLeaseStore,
) -> None:
    """The monitor's handoff write and the renew loop run concurrently in one router."""
    assert await store.swap(None, _record("router-a", 1))
    refused = 0
    for _ in range(OVERLAPS):
        written, renewed = await asyncio.gather(
            store.write_handoff("router-a", 1, b"{}"),
            store.renew("router-a", 1, time.time() + 10),
        )
        assert renewed
        refused += not written
    assert refused == 0, f"{refused} of {OVERLAPS} handoff writes refused to the holder"


async def test_a_healthy_etcd_holder_does_not_fence_itself(
    store: EtcdLeaseStore,
) -> None:
    clock = FakeClock(wall=time.time())
    cfg = LeaseConfig.model_validate({"backend": "etcd", "ttl_s": 10, "renew_interval_s": 2})
    keeper = LeaseKeeper("router-a", cfg, store, clock)
    assert await keeper.try_acquire(preempt=False)
    for _ in range(OVERLAPS):
        await asyncio.gather(keeper.renew(), keeper.write_handoff(b"{}"))
        assert keeper.role is Role.ACTIVE, keeper.fence_reason
