"""What `/ready` says: `ready_reason` as a table (DESIGN §3, spec "Monitoring and readiness").

Precedence, first that applies wins: the lease (standby or fenced), monitoring degraded,
then `starting: no verified <role> engine` (DESIGN §10), then capacity; roles in the order
prefill, decode, both. None means ready (200 `ready`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from narwhal.clock import FakeClock
from narwhal.config import Role, parse_config
from narwhal.fleet.events import EjectRequested
from narwhal.fleet.readiness import fleet_ready_reason, ready_reason
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from tests.support.fleet import verify_all

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


STARTING_P = "starting: no verified prefill engine"
STARTING_D = "starting: no verified decode engine"
STARTING_B = "starting: no verified both engine"

STARTING: list[tuple[str | None, str | None, Sequence[Role], Sequence[Role], str | None]] = [
    # lease    monitor  no capacity  unverified  -> reason
    (None, None, [P, D], [P, D], STARTING_P),
    (None, None, [D], [D], STARTING_D),
    (None, None, [B], [B], STARTING_B),
    (None, None, [], [D], STARTING_D),  # unverified wins even if capacity were reported
    # starting order is prefill, decode, both, whatever order the roles come in
    (None, None, [D, P], [D, P], STARTING_P),
    (None, None, [B, D], [B, D], STARTING_D),
    # starting before no capacity, whichever role each names
    (None, None, [P, D], [D], STARTING_D),
    (None, None, [P], [D], STARTING_D),
    # lease and monitor before starting
    (LEASE, None, [P, D], [P, D], LEASE),
    (FENCED, MONITOR, [D], [D], FENCED),
    (None, MONITOR, [P, D], [P, D], MONITOR),
    # nothing unverified: capacity as before
    (None, None, [D], [], "no capacity: decode"),
    (None, None, [], [], None),
]


@pytest.mark.parametrize(("lease", "monitor", "roles", "unverified", "expected"), STARTING)
def test_starting_comes_after_lease_and_monitor_and_before_capacity(
    lease: str | None,
    monitor: str | None,
    roles: Sequence[Role],
    unverified: Sequence[Role],
    expected: str | None,
) -> None:
    assert ready_reason(lease, monitor, roles, unverified) == expected


def test_ready_reason_does_not_mutate_its_input() -> None:
    roles = [B, D, P]
    ready_reason(None, None, roles)
    assert roles == [B, D, P]


# ------------------------------------------------------------- an embeddings model (issue 20)


def _fleet_with_embeddings(*engines: dict[str, str]) -> Fleet:
    cfg = parse_config({"model": "demo-model", "engines": list(engines)})
    return verify_all(Fleet(cfg.engines, FakeClock(), Policy.of(cfg.recovery)))


PD = (
    {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
)
E0 = {"id": "e0", "url": "http://127.0.0.1:9301", "role": "embed", "model": "bge"}


def test_an_embeddings_model_needs_its_embed_engines_and_nothing_else() -> None:
    fleet = _fleet_with_embeddings(*PD, E0)
    assert fleet.needed_roles("bge") == (Role.EMBED,)
    assert fleet.needed_roles("demo-model") == (P, D)
    assert fleet_ready_reason(None, None, fleet, 0.0) is None
    fleet.apply(EjectRequested("e0", "connection", "test"), 0.0)
    assert fleet_ready_reason(None, None, fleet, 0.0) == "no capacity: embed (model bge)"
    assert [c.id for c in fleet.candidates(P, 0.0, "demo-model")] == ["p0"]


def test_a_unified_engine_never_serves_embeddings_and_embed_engines_never_generate() -> None:
    both = {"id": "b0", "url": "http://127.0.0.1:9001", "role": "both", "kv_role": "kv_both"}
    fleet = _fleet_with_embeddings(both, E0)
    assert fleet.needed_roles() == (B,)  # the embed engine is not a generative one
    assert [c.id for c in fleet.candidates(Role.EMBED, 0.0)] == ["e0"]
    assert [c.id for c in fleet.candidates(B, 0.0)] == ["b0"]
    assert [c.id for c in fleet.candidates(P, 0.0)] == ["b0"]


def test_an_embed_router_alone_waits_for_a_verified_embed_engine() -> None:
    cfg = parse_config({"model": "bge", "engines": [E0]})
    fleet = Fleet(cfg.engines, FakeClock(), Policy.of(cfg.recovery))
    assert fleet_ready_reason(None, None, fleet, 0.0) == "starting: no verified embed engine"
