"""A discovery round honours a cancellation its source swallowed: dnspython waits with
`asyncio.wait_for`, which on Python 3.11 loses a cancellation arriving with the DNS answer,
and the router's shutdown then waited for the discovery loop forever (a hung CI run)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from narwhal.clock import FakeClock
from narwhal.config import DiscoveryConfig, EngineConfig, parse_config
from narwhal.control.discovery import Discovery
from narwhal.control.membership import Membership
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics


class SwallowingSource(Discovery):
    """A file source whose read loses the cancellation it receives, as 3.11's wait_for does
    when the awaited answer completes at the same moment."""

    async def _read_file(self) -> list[EngineConfig]:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        return []


async def test_a_round_raises_the_cancellation_its_source_swallowed(tmp_path: Path) -> None:
    cfg = parse_config(
        {"model": "m", "engines": [{"id": "b0", "url": "http://127.0.0.1:9001", "role": "both",
                                    "kv_role": "kv_both"}]}
    )  # fmt: skip
    clock = FakeClock()
    metrics = Metrics()
    fleet = Fleet(cfg.engines, clock, Policy.of(cfg.recovery))
    membership = Membership(fleet, metrics, clock, "vllm", "m", lambda: None)
    source = DiscoveryConfig(file=str(tmp_path / "engines.yaml"))
    discovery = SwallowingSource(source, membership, metrics, clock, lambda: True)
    with pytest.raises(asyncio.CancelledError):
        await discovery.round()
    task = asyncio.current_task()
    assert task is not None and task.uncancel() == 0  # the test's own task goes on
