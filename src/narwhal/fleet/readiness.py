"""What `/ready` says: one reason when not ready, by a fixed precedence.

Precedence (first that applies wins): the lease (standby or fenced), monitoring degraded,
then `starting: no verified <role> engine` per role (a role no verified engine serves yet,
DESIGN §10), then capacity per role; roles in the order prefill, decode, both, embed. With several
models, `/ready` is 200 only while every model has capacity; a model's line ends with
` (model NAME)`, models in name order. One model: the lines are as they always were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from narwhal.config import Role

if TYPE_CHECKING:
    from narwhal.fleet.store import Fleet

ROLE_ORDER = (Role.PREFILL, Role.DECODE, Role.BOTH, Role.EMBED)


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


def fleet_ready_reason(
    lease_reason: str | None, monitor_reason: str | None, fleet: Fleet, now: float
) -> str | None:
    """`ready_reason` over the fleet, model by model."""
    models = fleet.models()
    scopes: Sequence[str | None] = models if len(models) > 1 else [None]
    for model in scopes:
        without = [r for r in fleet.needed_roles(model) if not fleet.candidates(r, now, model)]
        reason = ready_reason(
            lease_reason, monitor_reason, without, fleet.roles_without_verified(model)
        )
        if reason is not None:
            if model is None or lease_reason is not None or monitor_reason is not None:
                return reason
            return f"{reason} (model {model})"
    return None
