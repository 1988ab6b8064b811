"""One router's `Ownership` (lease renewal, following, takeover) without the rest of the
Router, over a shared lease store and clock: the scenario tests run several of them in
virtual time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from narwhal.clock import Clock
from narwhal.config import parse_config
from narwhal.control.ownership import Leadership, Ownership, ReadyProbe
from narwhal.fleet.store import Fleet
from narwhal.state.handoff import HandoffWriter
from narwhal.state.lease import LeaseKeeper, LeaseStore
from narwhal.telemetry.metrics import Metrics
from tests.support.router import router_config

ENGINES = [{"id": "p0", "url": "http://127.0.0.1:9001", "role": "both"}]
ACTIVE_URL = "http://active.invalid:8000"


def make_ownership(
    tmp_path: Path,
    router_id: str,
    store: LeaseStore,
    clock: Clock,
    *,
    monitor_interval_s: float,
    lease: dict[str, Any],
    takeover_threshold: int = 3,
    probe_ready: ReadyProbe | None = None,
    leadership: Sequence[Leadership] = (),
) -> Ownership:
    """`router_id`'s ownership loop; with `probe_ready` it watches the active's `/ready`
    (at `ACTIVE_URL`) toward `takeover_threshold`, else it only waits for expiry."""
    standby: dict[str, Any] = {"takeover_threshold": takeover_threshold}
    if probe_ready is not None:
        standby["active_url"] = ACTIVE_URL
    config = parse_config(
        router_config(
            ENGINES,
            tmp_path / router_id,
            router_id=router_id,
            controller={"monitor_interval_s": monitor_interval_s},
            lease={"backend": "file", **lease},
            standby=standby,
        )
    )
    keeper = LeaseKeeper(router_id, config.lease, store, clock)
    fleet = Fleet(config.engines, clock)
    handoff = HandoffWriter(
        Path(config.handoff.path), router_id, fleet, clock, risk=dict, lease=keeper.handoff_lease
    )
    return Ownership(
        config,
        keeper,
        fleet,
        handoff,
        Metrics(),
        clock,
        probe_ready=probe_ready,
        leadership=leadership,
    )
