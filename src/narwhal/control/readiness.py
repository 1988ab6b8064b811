"""What `/ready` says: one reason when not ready, by a fixed precedence.

Precedence (first that applies wins): the lease (standby or fenced), monitoring degraded,
then capacity per role in the order prefill, decode, both.
"""

from __future__ import annotations

from collections.abc import Sequence

from narwhal.config import Role


def ready_reason(
    lease_reason: str | None,
    monitor_reason: str | None,
    roles_without_capacity: Sequence[Role],
) -> str | None:
    """None when ready; otherwise the single line `/ready` returns with 503."""
    if lease_reason is not None:
        return lease_reason
    if monitor_reason is not None:
        return monitor_reason
    for role in (Role.PREFILL, Role.DECODE, Role.BOTH):
        if role in roles_without_capacity:
            return f"no capacity: {role.value}"
    return None
