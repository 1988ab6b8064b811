"""Lifecycle holds: named reasons an engine gets no new requests.

`performance_drift` and `failure_quarantine` are soft: they never remove the last eligible
engine of a role (spec, "Last-engine protection"). The others always block placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class HoldName(StrEnum):
    OPERATOR_DRAIN = "operator_drain"
    PLANNED_MAINTENANCE = "planned_maintenance"
    INFERENCE_VERIFICATION = "inference_verification"
    FAILURE_QUARANTINE = "failure_quarantine"
    PERFORMANCE_DRIFT = "performance_drift"


SOFT_HOLDS = frozenset({HoldName.PERFORMANCE_DRIFT, HoldName.FAILURE_QUARANTINE})


@dataclass(frozen=True, slots=True)
class Hold:
    """A hold and, for temporary ones, its deadline on both clocks.

    The monotonic deadline drives decisions; the wall deadline is what the handoff persists.
    `newer_than` (planned maintenance only): readmission needs a process generation strictly
    newer than this one, the generation running when maintenance was requested.
    """

    name: HoldName
    reason: str
    since_wall: float
    deadline_mono: float | None = None
    deadline_wall: float | None = None
    newer_than: float | None = None

    def expired(self, now: float) -> bool:
        return self.deadline_mono is not None and now >= self.deadline_mono
