"""What `/ready` says: one reason when not ready, by a fixed precedence.

Precedence (first that applies wins): the lease (standby or fenced), monitoring degraded,
then `starting: no verified <role> engine` per role (a role no verified engine serves yet,
DESIGN §10), then capacity per role; roles in the order prefill, decode, both.
"""

from __future__ import annotations

from collections.abc import Sequence

from narwhal.config import Role

ROLE_ORDER = (Role.PREFILL, Role.DECODE, Role.BOTH)


def starting_reason(role: Role) -> str:
    """The line for a role no verified engine serves yet (`/ready` and new completions)."""
    return f"starting: no verified {role.value} engine"


def ready_reason(
    lease_reason: str | None,
    monitor_reason: str | None,
    roles_without_capacity: Sequence[Role],
    roles_unverified: Sequence[Role] = (),
) -> str | None:
    """None when ready; otherwise the single line `/ready` returns with 503."""
    if lease_reason is not None:
        return lease_reason
    if monitor_reason is not None:
        return monitor_reason
    for role in ROLE_ORDER:
        if role in roles_unverified:
            return starting_reason(role)
    for role in ROLE_ORDER:
        if role in roles_without_capacity:
            return f"no capacity: {role.value}"
    return None
