"""etcd's database size and alarms as gauges, so an operator sees the quota coming.

Every router with the etcd backend reads them, whatever its lease role: when etcd raises
NOSPACE every router fences, and the gauges are then the only view left of why. Two cheap
calls (`/v3/maintenance/status`, `/v3/maintenance/alarm`) every `interval_s`.
"""

from __future__ import annotations

import logging
from typing import Protocol

from narwhal.clock import Clock
from narwhal.state.etcd_store import EtcdStatus
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.etcd.status")

STATUS_INTERVAL_S = 30.0
"""How often the gauges are refreshed: etcd's size moves slowly next to a scrape interval;
the compaction interval when that is shorter (see `status_interval_s`)."""


def status_interval_s(compaction_interval_s: float) -> float:
    """Refresh at least every compaction tick, and at least every `STATUS_INTERVAL_S`."""
    if compaction_interval_s > 0:
        return min(STATUS_INTERVAL_S, compaction_interval_s)
    return STATUS_INTERVAL_S


class EtcdObservable(Protocol):
    async def status(self) -> EtcdStatus: ...

    async def alarms(self) -> frozenset[str]: ...


class EtcdStatusWatch:
    """Reads etcd's status and alarms into the router's gauges every `interval_s` on
    `clock` (the real one unless a test injects a fake)."""

    def __init__(
        self,
        etcd: EtcdObservable,
        metrics: Metrics,
        interval_s: float,
        clock: Clock,
    ) -> None:
        self._etcd = etcd
        self._metrics = metrics
        self.interval_s = interval_s
        self._clock = clock
        self.last: EtcdStatus | None = None
        self.alarms: frozenset[str] = frozenset()
        self.error: str | None = None

    async def run(self) -> None:
        while True:
            await self.refresh()
            await self._clock.sleep(self.interval_s)

    async def refresh(self) -> bool:
        """One read of both; a failure keeps the last values, is logged and counted."""
        try:
            status = await self._etcd.status()
            alarms = await self._etcd.alarms()
        except Exception as exc:  # the gauges go stale; the failure counter says so
            if self.error is None:
                log.warning("etcd status read failed: %s", exc)
            self.error = str(exc)
            self._metrics.etcd_status_reads.labels("failed").inc()
            return False
        m = self._metrics
        m.etcd_db_size.set(status.db_size_bytes)
        if status.db_size_in_use_bytes is not None:
            m.etcd_db_size_in_use.set(status.db_size_in_use_bytes)
        for alarm in alarms | self.alarms | {"NOSPACE", "CORRUPT"}:
            m.etcd_alarm.labels(alarm).set(int(alarm in alarms))
        if alarms - self.alarms:
            log.error("etcd alarm raised: %s", ", ".join(sorted(alarms - self.alarms)))
        self.last, self.alarms, self.error = status, alarms, None
        m.etcd_status_reads.labels("ok").inc()
        return True
