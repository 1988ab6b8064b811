"""Inference probes: whose fault a refused handoff, or a busy control pool, is.

A handoff the decode engine cannot use is a `kv_handoff` failure of the engine that produced it
(DESIGN §1). So a probe of a prefill engine whose handoff its decode peer refuses fails that
prefill engine; a probe of a decode engine that refuses its prefill peer's handoff is
inconclusive (the peer failed), never an ejection of the decode engine. A probe that cannot get
a control connection never asked the engine anything: inconclusive too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from narwhal.clock import FakeClock
from narwhal.config import Config, parse_config
from narwhal.control.lifecycle import Lifecycle
from narwhal.control.probes import InferenceProber, Verdict
from narwhal.engine.adapter import HandoffRefused, PrefillReply
from narwhal.engine.failures import FailureClass
from narwhal.engine.transport import ControlPoolBusy, EngineClient
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics
from tests.support.fleet import verify_all
from tests.support.router import router_config


class RefusingDecode:
    """A fake adapter: every prefill yields a handoff, every decode refuses it on restore."""

    def __init__(self) -> None:
        self.discarded: list[object] = []

    async def prefill(self, *args: Any) -> PrefillReply:
        return PrefillReply(200, b"{}", "application/json", {}, "a-handoff")

    @asynccontextmanager
    async def decode(self, *args: Any) -> AsyncIterator[dict[str, Any]]:
        raise HandoffRefused("the slot file did not restore")
        yield {}  # pragma: no cover  (makes this an async generator)

    async def discard(self, producer: object, handoff: object) -> None:
        self.discarded.append(handoff)

    def recomputed(self, final: bytes | None) -> str | None:
        return None


class BusyControlPool(RefusingDecode):
    """A fake adapter whose prefill found no free control connection."""

    async def prefill(self, *args: Any) -> PrefillReply:
        raise ControlPoolBusy(5.0)


def _prober(tmp_path: Path, adapter: RefusingDecode) -> tuple[InferenceProber, Fleet]:
    engines = [
        {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
        {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode"},
    ]
    config: Config = parse_config(router_config(engines, tmp_path))
    metrics, clock = Metrics(), FakeClock()
    fleet = verify_all(Fleet(config.engines, clock, Policy.of(config.recovery)))
    prober = InferenceProber(
        config,
        fleet,
        EngineClient(4, 2),  # never started: the fake adapter makes no requests
        Lifecycle(fleet),
        metrics,
        clock,
        lambda engine: adapter,  # type: ignore[arg-type]
    )
    return prober, fleet


async def test_a_decode_probe_on_a_refused_handoff_is_inconclusive(tmp_path: Path) -> None:
    adapter = RefusingDecode()
    prober, fleet = _prober(tmp_path, adapter)
    result = await prober.probe(fleet.get("d0"))
    assert result.verdict is Verdict.INCONCLUSIVE, result
    assert "p0" in result.reason and "refused" in result.reason
    assert adapter.discarded == ["a-handoff"]  # the producer's handoff is still cleaned up


async def test_a_prefill_probe_whose_handoff_is_refused_fails_the_prefill(tmp_path: Path) -> None:
    adapter = RefusingDecode()
    prober, fleet = _prober(tmp_path, adapter)
    result = await prober.probe(fleet.get("p0"))
    assert result.verdict is Verdict.FAILED, result
    assert result.failure_class is FailureClass.KV_HANDOFF
    assert adapter.discarded == ["a-handoff"]


async def test_a_probe_without_a_control_connection_is_inconclusive(tmp_path: Path) -> None:
    prober, fleet = _prober(tmp_path, BusyControlPool())
    result = await prober.probe(fleet.get("p0"))
    assert result.verdict is Verdict.INCONCLUSIVE, result
    assert "no control connection" in result.reason
