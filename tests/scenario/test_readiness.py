"""What `/ready` says: `ready_reason` as a table (DESIGN §3, spec "Monitoring and readiness").

Precedence, first that applies wins: the lease (standby or fenced), monitoring degraded,
then capacity per role in the order prefill, decode, both. None means ready (200 `ready`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from narwhal.config import Role
from narwhal.control.readiness import ready_reason

LEASE = "standby: lease held by router-a"
FENCED = "fenced: lease lost"
MONITOR = "monitoring degraded: handoff PermissionError"
P, D, B = Role.PREFILL, Role.DECODE, Role.BOTH

TABLE: list[tuple[str | None, str | None, Sequence[Role], str | None]] = [
    # lease    monitor  roles without capacity  -> reason
    (None, None, [], None),
    (None, None, (), None),
    (LEASE, None, [], LEASE),
    (FENCED, None, [], FENCED),
    (None, MONITOR, [], MONITOR),
    (None, None, [P], "no capacity: prefill"),
    (None, None, [D], "no capacity: decode"),
    (None, None, [B], "no capacity: both"),
    # capacity order is prefill, decode, both, whatever order the roles come in
    (None, None, [D, P], "no capacity: prefill"),
    (None, None, [P, D], "no capacity: prefill"),
    (None, None, [B, D], "no capacity: decode"),
    (None, None, [B, D, P], "no capacity: prefill"),
    (None, None, (D,), "no capacity: decode"),
    # monitor before capacity
    (None, MONITOR, [P], MONITOR),
    (None, MONITOR, [D, B], MONITOR),
    # lease before monitor and capacity
    (LEASE, MONITOR, [], LEASE),
    (LEASE, None, [P, D], LEASE),
    (FENCED, MONITOR, [P, D, B], FENCED),
    # reasons are returned verbatim
    (
        None,
        "monitoring degraded: telemetry RuntimeError",
        [],
        "monitoring degraded: telemetry RuntimeError",
    ),
    (
        None,
        "monitoring degraded: controller ZeroDivisionError",
        [B],
        "monitoring degraded: controller ZeroDivisionError",
    ),
]


@pytest.mark.parametrize(("lease", "monitor", "roles", "expected"), TABLE)
def test_ready_reason(
    lease: str | None, monitor: str | None, roles: Sequence[Role], expected: str | None
) -> None:
    assert ready_reason(lease, monitor, roles) == expected


def test_ready_reason_does_not_mutate_its_input() -> None:
    roles = [B, D, P]
    ready_reason(None, None, roles)
    assert roles == [B, D, P]
