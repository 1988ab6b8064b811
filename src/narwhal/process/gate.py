"""A worker's admission and `/ready`, judged on its own from the control process's last word.

The control process sends the lease's admission window, the monitor's reason and a
`valid_until` it moves forward with every heartbeat. The worker judges at each request with
its own `now` (the monotonic clock is system-wide), so it fences at the lease's local expiry
and stops admitting when the control process goes quiet, with no timer of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from narwhal.clock import Clock
from narwhal.fleet.readiness import fleet_ready_reason
from narwhal.fleet.store import Fleet
from narwhal.state.lease import AdmissionWindow, lease_reason_at

CONTROL_LOST = "control process lost"
DRAINING = "draining: shutting down"


@dataclass(frozen=True, slots=True)
class GateData:
    lease: AdmissionWindow | None  # None: no lease (a single router)
    monitor: str | None
    valid_until: float  # monotonic: past this the control process counts as lost

    def to_json(self) -> dict[str, Any]:
        lease = self.lease
        return {
            "lease": None if lease is None else [lease.static, lease.fence_at, lease.admit_after],
            "monitor": self.monitor,
            "valid_until": self.valid_until,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GateData:
        lease = data["lease"]
        return cls(
            None if lease is None else AdmissionWindow(*lease), data["monitor"], data["valid_until"]
        )


def closed_reason_at(data: GateData | None, now: float, lost: bool, draining: bool) -> str | None:
    """Why new requests are refused at `now`: the lease first (a lease judged lost from the
    control process's last word is lost, whatever happened to that process since), then a
    lost control process, draining, and the monitor. Pure."""
    if data is None:
        return CONTROL_LOST
    lease = lease_reason_at(data.lease, now) if data.lease is not None else None
    if lease is not None:
        return lease
    if lost or now >= data.valid_until:
        return CONTROL_LOST
    if draining:
        return DRAINING
    return data.monitor


class WorkerGate:
    """The `Gate` the worker's data plane asks, and the worker's `/ready` line."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.data: GateData | None = None
        self.lost = False
        self.draining = False

    def closed_reason(self) -> str | None:
        return closed_reason_at(self.data, self._clock.monotonic(), self.lost, self.draining)

    def ready(self, fleet: Fleet) -> str | None:
        now = self._clock.monotonic()
        closed = closed_reason_at(self.data, now, self.lost, self.draining)
        if closed is not None and (self.data is None or closed != self.data.monitor):
            return closed  # the lease, a lost control process or draining: before the rest
        return fleet_ready_reason(None, closed, fleet, now)
