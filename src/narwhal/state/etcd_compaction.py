"""etcd history compaction by the lease holder, as kube-apiserver does it.

Every handoff write and renewal adds a revision to etcd's history, and etcd keeps every
revision until someone compacts it; when its backend quota fills, etcd raises NOSPACE and
refuses every write, lease renewals included. So the holder compacts, every
`lease.compaction_interval_s`, to the newest revision it saw at least one interval ago:
at least one interval of history is always kept. `decide` is that rule, over the marks
(time, revision) taken at earlier ticks; `Compactor` runs it in the holder's leadership
scope. A failure is logged and counted, never fatal. docs/lease.md says what compaction
does to other users of the same etcd.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from narwhal.clock import Clock
from narwhal.state.etcd_store import EtcdStatus
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.etcd.compaction")


class Result(StrEnum):
    OK = "ok"
    ALREADY_COMPACTED = "already_compacted"  # someone compacted at or past it: fine
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Mark:
    """etcd's revision as read at monotonic time `at_s` (taken after the read returned, so
    everything written after `at_s` has a higher revision)."""

    at_s: float
    revision: int


@dataclass(frozen=True, slots=True)
class History:
    """What the compactor remembers between ticks."""

    marks: tuple[Mark, ...] = ()
    compacted: int = 0  # the revision last compacted to (by us, or found compacted); 0: none


@dataclass(frozen=True, slots=True)
class Decision:
    history: History
    compact_to: int | None


def decide(history: History, now: float, revision: int, retention_s: float) -> Decision:
    """Compact to the newest marked revision at least `retention_s` old, and mark `revision`.

    History newer than that mark (at least `retention_s` of it) is kept. Nothing is compacted
    at the first tick, nor twice to the same revision. A revision below the newest mark means
    etcd's history started over (a new or restored cluster): the old marks are forgotten.
    """
    marks, compacted = history.marks, history.compacted
    if marks and revision < marks[-1].revision:
        marks, compacted = (), 0
    cutoff = now - retention_s
    due = [m.revision for m in marks if m.at_s <= cutoff]
    target = max(due) if due and max(due) > compacted else None
    kept = tuple(m for m in marks if m.at_s > cutoff)
    return Decision(History((*kept, Mark(now, revision)), compacted), target)


class EtcdMaintenance(Protocol):
    """The two etcd calls compaction needs (`EtcdLeaseStore` has them)."""

    async def status(self) -> EtcdStatus: ...

    async def compact(self, revision: int) -> bool:
        """False when already compacted at or past `revision`; raises StoreUnavailable."""
        ...


class Compactor:
    """Compacts etcd every `interval_s` while this router holds the lease.

    `run` belongs in the leadership scope (started on acquiring, cancelled on fencing or
    shutdown); `tick` is one step, callable directly with a fake clock."""

    def __init__(
        self, etcd: EtcdMaintenance, interval_s: float, metrics: Metrics, clock: Clock
    ) -> None:
        self._etcd = etcd
        self.interval_s = interval_s
        self._metrics = metrics
        self._clock = clock
        self.history = History()
        self.last_result: Result | None = None

    async def run(self) -> None:
        while True:
            await self.tick()
            await self._clock.sleep(self.interval_s)

    async def tick(self) -> Result | None:
        """Read the revision, decide, compact. None when nothing was due."""
        try:
            status = await self._etcd.status()
        except Exception as exc:  # never fatal: the next tick tries again
            return self._count(Result.FAILED, None, f"status read failed: {exc}")
        decision = decide(self.history, self._clock.monotonic(), status.revision, self.interval_s)
        self.history = decision.history
        target = decision.compact_to
        if target is None:
            return None
        try:
            done = await self._etcd.compact(target)
        except Exception as exc:
            return self._count(Result.FAILED, target, str(exc))
        self.history = dataclasses.replace(self.history, compacted=target)
        return self._count(Result.OK if done else Result.ALREADY_COMPACTED, target, None)

    def _count(self, result: Result, target: int | None, error: str | None) -> Result:
        self._metrics.etcd_compactions.labels(result.value).inc()
        self.last_result = result
        extra = {"etcd_event": "compaction", "result": result.value, "revision": target}
        if error is not None:
            log.warning("etcd compaction to %s failed: %s", target, error, extra=extra)
        else:
            log.info("etcd compaction to revision %d: %s", target, result.value, extra=extra)
        return result
