"""etcd history compaction: the schedule decision and the compactor's ticks.

`decide` is table-driven; the compactor runs tick by tick on a fake clock against a fake etcd
(failures are counted and never fatal, "already compacted" is fine). Its schedule in the
holder's leadership scope runs in virtual time in
tests/scenario/test_etcd_compaction_schedule.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from narwhal.clock import FakeClock
from narwhal.config import LeaseConfig, parse_config
from narwhal.server import Router
from narwhal.state.etcd_compaction import Compactor, Decision, History, Mark, Result, decide
from narwhal.state.etcd_status import STATUS_INTERVAL_S, EtcdStatusWatch, status_interval_s
from narwhal.state.etcd_store import EtcdStatus
from narwhal.state.lease import StoreUnavailable
from narwhal.telemetry.metrics import Metrics
from tests.support.router import router_config

INTERVAL_S = 300.0


class FakeEtcd:
    """etcd's revision counter, its compaction point and alarms; `fail` makes the next calls
    raise (a store outage, or an error answer)."""

    def __init__(self) -> None:
        self.revision = 1
        self.compacted = 0
        self.db_size = 4096
        self.alarm_set: frozenset[str] = frozenset()
        self.fail_status: Exception | None = None
        self.fail_compact: Exception | None = None
        self.status_calls = 0
        self.compactions: list[int] = []

    async def status(self) -> EtcdStatus:
        self.status_calls += 1
        if self.fail_status is not None:
            raise self.fail_status
        return EtcdStatus(self.revision, self.db_size, self.db_size // 2)

    async def alarms(self) -> frozenset[str]:
        return self.alarm_set

    async def compact(self, revision: int) -> bool:
        self.compactions.append(revision)
        if self.fail_compact is not None:
            raise self.fail_compact
        if revision <= self.compacted:
            return False
        self.compacted = revision
        return True


def counted(metrics: Metrics, result: str) -> float:
    value = metrics.registry.get_sample_value("narwhal_etcd_compactions_total", {"result": result})
    assert value is not None
    return value


# --------------------------------------------------------------------------- config


def test_the_compaction_interval_is_a_number_at_least_zero() -> None:
    assert LeaseConfig.model_validate({"backend": "etcd"}).compaction_interval_s == 300.0
    assert LeaseConfig.model_validate({"compaction_interval_s": 0}).compaction_interval_s == 0
    for bad in (-1, "300", True, float("inf")):
        with pytest.raises(ValidationError):
            LeaseConfig.model_validate({"backend": "etcd", "compaction_interval_s": bad})


def test_the_file_backend_ignores_the_compaction_interval(tmp_path: Path) -> None:
    engines = [{"id": "p0", "url": "http://127.0.0.1:9001", "role": "both"}]
    lease = {"backend": "file", "path": str(tmp_path / "lease.json"), "compaction_interval_s": 60}
    router = Router(parse_config(router_config(engines, tmp_path, lease=lease)))
    assert router.compactor is None and router.etcd_status is None
    etcd = {"backend": "etcd", "compaction_interval_s": 0}
    router = Router(parse_config(router_config(engines, tmp_path, lease=etcd)))
    assert router.compactor is None and router.etcd_status is not None  # size still watched


# --------------------------------------------------------------------------- decide


@pytest.mark.parametrize(
    ("history", "now", "revision", "want"),
    [
        # The first tick only marks: nothing is known to be old enough yet.
        (History(), 1000.0, 50, None),
        # One interval later: compact to the revision seen then.
        (History((Mark(1000.0, 50),)), 1300.0, 90, 50),
        # Less than an interval later (a tick delayed the other way): keep waiting.
        (History((Mark(1000.0, 50),)), 1299.9, 90, None),
        # The newest of the old-enough marks; the younger one is kept for later.
        (History((Mark(700.0, 10), Mark(1000.0, 50), Mark(1200.0, 70))), 1300.0, 90, 50),
        # Never twice to the same revision (no writes since: etcd would refuse).
        (History((Mark(1000.0, 50),), compacted=50), 1300.0, 50, None),
        # etcd's history started over (a new cluster): old marks are forgotten.
        (History((Mark(1000.0, 5000),), compacted=4000), 1300.0, 20, None),
    ],
    ids=["first-tick", "one-interval", "not-yet", "newest-old-mark", "no-repeat", "restarted"],
)
def test_decide_compacts_to_the_newest_mark_at_least_one_interval_old(
    history: History, now: float, revision: int, want: int | None
) -> None:
    decision = decide(history, now, revision, INTERVAL_S)
    assert decision.compact_to == want
    assert decision.history.marks[-1] == Mark(now, revision)
    assert all(m.at_s > now - INTERVAL_S for m in decision.history.marks)


def test_after_a_restart_of_etcd_history_the_next_interval_compacts_again() -> None:
    d: Decision = decide(History((Mark(1000.0, 5000),), 4000), 1300.0, 20, INTERVAL_S)
    assert d.history == History((Mark(1300.0, 20),), 0)
    assert decide(d.history, 1600.0, 80, INTERVAL_S).compact_to == 20


# --------------------------------------------------------------------------- the compactor


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_each_tick_compacts_to_the_revision_of_the_tick_before(clock: FakeClock) -> None:
    etcd, metrics = FakeEtcd(), Metrics()
    compactor = Compactor(etcd, INTERVAL_S, metrics, clock)
    revisions = [10, 400, 790, 1200]
    results = []
    for revision in revisions:
        etcd.revision = revision
        results.append(await compactor.tick())
        clock.advance(INTERVAL_S)
    assert results == [None, Result.OK, Result.OK, Result.OK]
    assert etcd.compactions == [10, 400, 790]  # always one interval behind
    assert counted(metrics, "ok") == 3
    assert counted(metrics, "failed") == counted(metrics, "already_compacted") == 0


async def test_a_failing_compaction_is_counted_and_the_next_tick_compacts(
    clock: FakeClock,
) -> None:
    etcd, metrics = FakeEtcd(), Metrics()
    compactor = Compactor(etcd, INTERVAL_S, metrics, clock)
    await compactor.tick()  # the first mark
    clock.advance(INTERVAL_S)
    etcd.revision = 200
    etcd.fail_compact = StoreUnavailable("etcd unreachable: connection refused")
    assert await compactor.tick() is Result.FAILED
    etcd.fail_status = RuntimeError("a bug in a parser")  # not even a StoreUnavailable
    clock.advance(INTERVAL_S)
    assert await compactor.tick() is Result.FAILED
    assert counted(metrics, "failed") == 2
    etcd.fail_status = etcd.fail_compact = None
    clock.advance(INTERVAL_S)
    etcd.revision = 300
    assert await compactor.tick() is Result.OK
    assert etcd.compacted == 200  # the mark taken at the failed tick is still used
    assert counted(metrics, "ok") == 1


async def test_another_client_compacting_further_is_fine(clock: FakeClock) -> None:
    etcd, metrics = FakeEtcd(), Metrics()
    compactor = Compactor(etcd, INTERVAL_S, metrics, clock)
    etcd.revision = 100
    await compactor.tick()
    etcd.revision, etcd.compacted = 500, 450  # e.g. etcd's own --auto-compaction
    clock.advance(INTERVAL_S)
    assert await compactor.tick() is Result.ALREADY_COMPACTED
    assert counted(metrics, "already_compacted") == 1
    clock.advance(INTERVAL_S)
    etcd.revision = 900
    assert await compactor.tick() is Result.OK
    assert etcd.compacted == 500


# --------------------------------------------------------------------------- status gauges


async def test_the_status_watch_exports_size_and_alarms_and_survives_failures() -> None:
    etcd, metrics = FakeEtcd(), Metrics()
    watch = EtcdStatusWatch(etcd, metrics, 30.0, FakeClock())
    etcd.db_size, etcd.alarm_set = 3_000_000, frozenset({"NOSPACE"})
    assert await watch.refresh()

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert sample("narwhal_etcd_db_size_bytes") == 3_000_000
    assert sample("narwhal_etcd_db_size_in_use_bytes") == 1_500_000
    assert sample("narwhal_etcd_alarm_active", alarm="NOSPACE") == 1
    assert sample("narwhal_etcd_alarm_active", alarm="CORRUPT") == 0
    etcd.fail_status = StoreUnavailable("etcd unreachable")
    assert not await watch.refresh()
    assert sample("narwhal_etcd_status_reads_total", result="failed") == 1
    assert sample("narwhal_etcd_db_size_bytes") == 3_000_000  # the last value stays
    etcd.fail_status, etcd.alarm_set = None, frozenset()
    assert await watch.refresh()
    assert sample("narwhal_etcd_alarm_active", alarm="NOSPACE") == 0


def test_the_status_is_read_at_least_every_compaction_tick() -> None:
    assert status_interval_s(300.0) == STATUS_INTERVAL_S
    assert status_interval_s(5.0) == 5.0
    assert status_interval_s(0.0) == STATUS_INTERVAL_S  # compaction off: still exported
