"""etcd maintenance on its schedule in virtual time: compaction by the lease holder only, in
its leadership scope, every `compaction_interval_s`; the status gauges every interval.

router-b's real `Ownership` loop runs a `Compactor` as its leadership work over an in-memory
lease store and a fake etcd; router-a holds the lease at first and never renews it. The
decision rule itself is table-driven in tests/unit/test_etcd_compaction.py; a real etcd's
quota is in tests/e2e/test_etcd_compaction.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from narwhal.clock import FakeClock
from narwhal.state.etcd_compaction import Compactor
from narwhal.state.etcd_status import EtcdStatusWatch
from narwhal.state.lease import LeaseRecord, Role
from narwhal.telemetry.metrics import Metrics
from tests.support.ownership import make_ownership
from tests.unit.test_etcd_compaction import FakeEtcd, counted
from tests.unit.test_lease_keeper import MemoryLeaseStore

T0 = 1000.0
TTL_S = 10.0
RENEW_S = 2.0
STEP_S = 1.0
INTERVAL_S = 300.0
HOUR_S = 3600.0


async def test_only_the_holder_compacts_on_its_schedule_and_fencing_stops_it(
    tmp_path: Path,
) -> None:
    clock = FakeClock(monotonic=T0)
    store = MemoryLeaseStore(clock)
    etcd = FakeEtcd()
    metrics = Metrics()
    compactor = Compactor(etcd, INTERVAL_S, metrics, clock)
    lease = {"ttl_s": TTL_S, "renew_interval_s": RENEW_S}
    a = make_ownership(tmp_path, "router-a", store, clock, monitor_interval_s=STEP_S, lease=lease)
    b = make_ownership(
        tmp_path, "router-b", store, clock, monitor_interval_s=STEP_S, lease=lease,
        leadership=[compactor.run],
    )  # fmt: skip
    await a.start(standby=False)  # router-a's lease expires at T0 + TTL_S: it never renews
    await b.start(standby=True)
    loop = asyncio.create_task(b.run())
    try:
        # A standby steps every second and never calls etcd's maintenance API.
        await clock.run_for(TTL_S - 0.5)
        assert b.keeper.role is Role.STANDBY and b.leading is None
        assert etcd.status_calls == 0

        # At the expiry router-b takes the lease; its scope opens and ticks at once (a mark,
        # nothing old enough to compact yet).
        await clock.run_for(0.5)
        assert b.keeper.role is Role.ACTIVE and b.leading is not None
        assert (etcd.status_calls, etcd.compactions) == (1, [])

        # A tick every interval, never sooner; each compacts to the revision marked at the
        # previous one (at least one interval of history is kept).
        for ticks, revision in enumerate((50, 90, 140), start=2):
            etcd.revision = revision
            await clock.run_for(INTERVAL_S - 1.0)
            assert etcd.status_calls == ticks - 1
            await clock.run_for(1.0)
            assert etcd.status_calls == ticks
        assert etcd.compactions == [1, 50, 90]
        assert counted(metrics, "ok") == 3
        assert b.keeper.admission_reason(clock.monotonic()) is None  # renewed all along

        # router-c takes the lease: router-b fences at its next renewal, the scope is
        # cancelled, and no maintenance call follows, however long it runs.
        record = store.record
        assert record is not None
        taken = LeaseRecord("router-c", record.epoch + 1, clock.wall() + HOUR_S)
        assert await store.swap(record, taken)
        scope = b.leading
        await clock.run_for(RENEW_S)
        assert b.keeper.role is Role.FENCED and b.leading is None
        assert scope is not None and scope.cancelled()
        calls = (etcd.status_calls, len(etcd.compactions))
        await clock.run_for(10 * INTERVAL_S)
        assert (etcd.status_calls, len(etcd.compactions)) == calls
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_the_status_gauges_are_read_every_interval() -> None:
    clock = FakeClock(monotonic=T0)
    etcd = FakeEtcd()
    watch = EtcdStatusWatch(etcd, Metrics(), 30.0, clock)
    task = asyncio.create_task(watch.run())
    try:
        await clock.run_for(95.0)
        assert etcd.status_calls == 4  # T0, T0 + 30, + 60, + 90
        assert watch.last is not None and watch.error is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
