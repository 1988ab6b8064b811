"""Discovery rounds, on a fake clock.

A round honours a cancellation its source swallowed: dnspython waits with
`asyncio.wait_for`, which on Python 3.11 loses a cancellation arriving with the DNS answer,
and the router's shutdown then waited for the discovery loop forever (a hung CI run).

A discovered member's grace period counts from the answer that showed it gone, not from
when the question was asked: a slow answer (a DNS server restarting, a loaded host) must not
shorten it. Found by a CI run where a pod left 0.98 s into a 1 s grace.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, TypeVar

import pytest

from narwhal.clock import FakeClock
from narwhal.config import DiscoveryConfig, EngineConfig, Role, parse_config
from narwhal.control.discovery import Discovery
from narwhal.control.membership import Membership
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

GRACE_S = 1.0
D0 = EngineConfig(id="d0", url="http://127.0.0.1:9002", role=Role.DECODE, kv_role="kv_consumer")


T = TypeVar("T", bound=Discovery)


def _discovery(kind: type[T], tmp_path: Path, **source: Any) -> tuple[T, Membership, FakeClock]:
    """A file source of class `kind` over a one-engine fleet, on a fake clock."""
    cfg = parse_config(
        {"model": "m", "engines": [{"id": "b0", "url": "http://127.0.0.1:9001", "role": "both",
                                    "kv_role": "kv_both"}]}
    )  # fmt: skip
    clock = FakeClock()
    metrics = Metrics()
    fleet = Fleet(cfg.engines, clock, Policy.of(cfg.recovery))
    membership = Membership(fleet, metrics, clock, "vllm", "m", lambda: None)
    config = DiscoveryConfig(file=str(tmp_path / "engines.yaml"), **source)
    return kind(config, membership, metrics, clock, lambda: True), membership, clock


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
    discovery, _, _ = _discovery(SwallowingSource, tmp_path)
    with pytest.raises(asyncio.CancelledError):
        await discovery.round()
    task = asyncio.current_task()
    assert task is not None and task.uncancel() == 0  # the test's own task goes on


class SlowSource(Discovery):
    """A file source that answers `found`, `slow_s` after it was asked (on the fake clock)."""

    found: list[EngineConfig]
    slow_s: float = 0.0

    async def _read_file(self) -> list[EngineConfig]:
        assert isinstance(self._clock, FakeClock)
        self._clock.advance(self.slow_s)
        return list(self.found)


async def test_the_grace_period_starts_when_the_answer_arrives(tmp_path: Path) -> None:
    discovery, membership, clock = _discovery(SlowSource, tmp_path, grace_s=GRACE_S)
    discovery.found = [D0]
    await discovery.round()
    assert [e.id for e in membership.members("file")] == ["d0"]

    discovery.found, discovery.slow_s = [], 0.8  # d0 is gone; the answer takes 0.8 s
    await discovery.round()
    seen_gone = clock.monotonic()
    discovery.slow_s = 0.0
    clock.advance(GRACE_S - 0.05)  # 1.75 s after the question, 0.95 s after the answer
    await discovery.round()
    assert [e.id for e in membership.members("file")] == ["d0"]

    clock.advance(0.05)
    assert clock.monotonic() - seen_gone >= GRACE_S
    await discovery.round()
    assert membership.members("file") == []
