"""A discovered member's grace period counts from the answer that showed it gone, not from
when the question was asked: a slow answer (a DNS server restarting, a loaded host) must not
shorten it. Found by a CI run where a pod left 0.98 s into a 1 s grace."""

from __future__ import annotations

from pathlib import Path

from narwhal.clock import FakeClock
from narwhal.config import DiscoveryConfig, EngineConfig, Role, parse_config
from narwhal.control.discovery import Discovery
from narwhal.control.membership import Membership
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

GRACE_S = 1.0
D0 = EngineConfig(id="d0", url="http://127.0.0.1:9002", role=Role.DECODE, kv_role="kv_consumer")


class SlowSource(Discovery):
    """A file source that answers `found`, `slow_s` after it was asked (on the fake clock)."""

    found: list[EngineConfig]
    slow_s: float = 0.0

    async def _read_file(self) -> list[EngineConfig]:
        assert isinstance(self._clock, FakeClock)
        self._clock.advance(self.slow_s)
        return list(self.found)


async def test_the_grace_period_starts_when_the_answer_arrives(tmp_path: Path) -> None:
    cfg = parse_config(
        {"model": "m", "engines": [{"id": "b0", "url": "http://127.0.0.1:9001", "role": "both",
                                    "kv_role": "kv_both"}]}
    )  # fmt: skip
    clock = FakeClock()
    metrics = Metrics()
    fleet = Fleet(cfg.engines, clock, Policy.of(cfg.recovery))
    membership = Membership(fleet, metrics, clock, "vllm", "m", lambda: None)
    source = DiscoveryConfig(file=str(tmp_path / "engines.yaml"), grace_s=GRACE_S)
    discovery = SlowSource(source, membership, metrics, clock, lambda: True)
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
