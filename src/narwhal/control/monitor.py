"""The monitor pass: stages in a fixed order, each isolated, and the failure streak.

`run_pass(now)` is the whole body; `run_forever` only schedules it, never overlapping a
pass with the previous one. A stage that raises is recorded (stage, exception class),
counted, and the pass goes on. At `monitor_failure_limit` consecutive failing passes the
router stops admitting; one fully successful pass reopens admission.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from narwhal.clock import Clock
from narwhal.fleet.admission import Admission
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.monitor")

STAGE_ORDER = (
    "controller",
    "health",
    "drains",
    "rollover",
    "readmission",
    "liveness",
    "telemetry",
    "handoff",
)

Stage = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class StageResult:
    stage: str
    duration_s: float
    error: str | None = None  # the exception's class name
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "duration_s": round(self.duration_s, 6),
            "ok": self.error is None,
            "error": self.error,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class PassReport:
    number: int
    started_at: float
    stages: tuple[StageResult, ...]

    @property
    def failed(self) -> StageResult | None:
        return next((s for s in self.stages if s.error is not None), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "pass": self.number,
            "started_at": self.started_at,
            "ok": self.failed is None,
            "stages": [s.to_json() for s in self.stages],
        }


@dataclass(slots=True)
class MonitorStatus:
    streak: int = 0
    passes: int = 0
    degraded_reason: str | None = None
    history: deque[PassReport] = field(default_factory=lambda: deque(maxlen=20))


class Monitor:
    def __init__(
        self,
        stages: Mapping[str, Stage],
        failure_limit: int,
        admission: Admission,
        metrics: Metrics,
        clock: Clock,
    ) -> None:
        missing = [s for s in STAGE_ORDER if s not in stages]
        if missing:
            raise ValueError(f"monitor stages missing: {missing}")
        self._stages = stages
        self._limit = failure_limit
        self._admission = admission
        self._metrics = metrics
        self._clock = clock
        self.status = MonitorStatus()

    async def run_pass(self, now: float) -> PassReport:
        started_at = self._clock.wall()
        results = []
        for name in STAGE_ORDER:
            t0 = time.perf_counter()
            try:
                await self._stages[name](now)
            except Exception as exc:  # stage isolation is the point
                cls = type(exc).__name__
                results.append(StageResult(name, time.perf_counter() - t0, cls, str(exc)[:500]))
                self._metrics.monitor_stage_errors.labels(name, cls).inc()
                log.warning(
                    "monitor stage %s failed: %s: %s",
                    name,
                    cls,
                    exc,
                    extra={"stage": name, "exception": cls, "detail": str(exc)[:500]},
                )
            else:
                results.append(StageResult(name, time.perf_counter() - t0))
            self._metrics.monitor_stage_seconds.labels(name).observe(results[-1].duration_s)
        st = self.status
        st.passes += 1
        report = PassReport(st.passes, started_at, tuple(results))
        st.history.append(report)
        self._account(report)
        return report

    def _account(self, report: PassReport) -> None:
        st = self.status
        first = report.failed
        if first is None:
            if st.streak:
                log.info("monitor recovered after %d failing passes", st.streak)
            st.streak = 0
            st.degraded_reason = None
            self._admission.open("monitor")
        else:
            st.streak += 1
            if st.streak >= self._limit:
                reason = f"monitoring degraded: {first.stage} {first.error}"
                if st.degraded_reason != reason:
                    log.error("%s (streak %d)", reason, st.streak)
                st.degraded_reason = reason
                self._admission.close("monitor", reason)
        self._metrics.monitor_passes.labels("ok" if first is None else "failed").inc()
        self._metrics.monitor_failure_streak.set(st.streak)

    async def run_forever(
        self, interval_s: float, should_run: Callable[[], bool] = lambda: True
    ) -> None:
        """Run a pass every interval; a slow pass delays the next, never overlaps it.

        `should_run` pauses passes while this router does not own serving (a standby).
        """
        while True:
            started = self._clock.monotonic()
            if should_run():
                await self.run_pass(started)
            elapsed = self._clock.monotonic() - started
            await self._clock.sleep(max(0.0, interval_s - elapsed))

    def to_json(self) -> dict[str, Any]:
        st = self.status
        return {
            "streak": st.streak,
            "failure_limit": self._limit,
            "passes": st.passes,
            "degraded": st.degraded_reason,
            "admitting": self._admission.admitting,
            "last_passes": [p.to_json() for p in reversed(st.history)],
        }
