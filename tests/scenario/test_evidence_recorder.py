"""Failure evidence (spec "Failure evidence", "Clearing failure evidence", "Liveness").

`EvidenceRecorder` keeps consecutive streaks per engine and per failure class, clears exactly
what each row of the clearing table names, and hands the class's action to its handlers when
a streak reaches `recovery.eject_after`. The last part checks the liveness column of the
"Health 200" row through the router's own health paths, against a tiny loopback engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from narwhal.clock import FakeClock
from narwhal.config import Config, parse_config
from narwhal.control.evidence import EvidenceRecorder
from narwhal.engine.failures import EngineFailure, FailureClass, SuccessKind
from narwhal.fleet.events import InferenceVerified, LegFailed, LivenessSwept, SuspectProbe
from narwhal.fleet.holds import HoldName
from narwhal.fleet.reducer import Action, Policy, action_for
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.server import Router
from narwhal.telemetry.fleet_metrics import watch_fleet
from narwhal.telemetry.metrics import Metrics
from tests.support.fleet import ActionRecord, record_actions, verify_all

C = FailureClass
ALL = frozenset(FailureClass)
EJECT_AFTER = 3

# The spec's failure table, written out independently of the code.
ACTIONS: dict[FailureClass, Action] = {
    C.CONNECTION: Action.EJECT,
    C.TIMEOUT: Action.HEALTH_PROBE,
    C.OVERLOAD: Action.HEALTH_PROBE,
    C.STREAM: Action.HOLD_AND_PROBE,
    C.INFERENCE_STATUS: Action.HOLD_AND_PROBE,
    C.KV_HANDOFF: Action.HOLD_AND_PROBE,
}

# The spec's clearing table (failure classes only; Health 200 also resets liveness, tested
# below through the health paths). PREFILL_FINISHED is DESIGN §1's "prefill finished the
# request" success: a 2xx with no handoff to extract, so it cannot clear kv_handoff.
CLEARING: dict[SuccessKind, frozenset[FailureClass]] = {
    SuccessKind.CLIENT_4XX: frozenset({C.CONNECTION, C.INFERENCE_STATUS}),
    SuccessKind.HEALTH_OK: frozenset({C.CONNECTION, C.TIMEOUT, C.OVERLOAD}),
    SuccessKind.PREFILL_HANDOFF: frozenset({C.CONNECTION, C.INFERENCE_STATUS, C.KV_HANDOFF}),
    SuccessKind.PREFILL_FINISHED: frozenset({C.CONNECTION, C.INFERENCE_STATUS}),
    SuccessKind.DECODE_DONE: frozenset({C.CONNECTION, C.INFERENCE_STATUS, C.STREAM}),
    SuccessKind.EMBEDDED: frozenset({C.CONNECTION, C.INFERENCE_STATUS}),
}


def config(**recovery: Any) -> Config:
    return parse_config(
        {
            "model": "demo-model",
            "engines": [
                {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
                {"id": "p1", "url": "http://127.0.0.1:9002", "role": "prefill"},
                {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
            ],
            "recovery": recovery,
        }
    )


@dataclass
class Rig:
    fleet: Fleet
    metrics: Metrics
    recorder: EvidenceRecorder
    actions: list[ActionRecord] = field(default_factory=list)

    def fail(self, engine_id: str, cls: FailureClass, times: int = 1, detail: str = "x") -> None:
        for _ in range(times):
            self.recorder.failure(engine_id, EngineFailure(cls, detail), "test")

    def streaks(self, engine_id: str) -> dict[FailureClass, int]:
        return dict(self.fleet.get(engine_id).evidence)

    def gauge(self, engine_id: str, cls: FailureClass) -> float | None:
        return self.metrics.registry.get_sample_value(
            "narwhal_evidence_streak", {"engine": engine_id, "failure_class": cls.value}
        )


def rig(eject_after: int = EJECT_AFTER) -> Rig:
    clock = FakeClock()
    fleet = verify_all(Fleet(config().engines, clock, Policy(eject_after=eject_after)))
    metrics = Metrics()
    watch_fleet(fleet, metrics, clock)
    recorder = EvidenceRecorder(fleet, clock)
    return Rig(fleet, metrics, recorder, record_actions(fleet, recorder))


def test_the_clearing_table_covers_every_success_kind() -> None:
    assert set(CLEARING) == set(SuccessKind)


# --------------------------------------------------------------------------- streaks
def test_streaks_are_separate_per_engine_and_per_class() -> None:
    r = rig(eject_after=100)
    r.fail("p0", C.CONNECTION, 2)
    r.fail("p0", C.TIMEOUT)
    r.fail("p1", C.CONNECTION)
    r.fail("p0", C.CONNECTION)
    r.fail("d0", C.STREAM, 4)
    assert r.streaks("p0") == {C.CONNECTION: 3, C.TIMEOUT: 1}
    assert r.streaks("p1") == {C.CONNECTION: 1}
    assert r.streaks("d0") == {C.STREAM: 4}
    assert r.gauge("p0", C.CONNECTION) == 3
    assert r.gauge("p1", C.CONNECTION) == 1
    failures = r.metrics.registry.get_sample_value(
        "narwhal_engine_failures_total", {"engine": "d0", "failure_class": "stream"}
    )
    assert failures == 4


def test_a_failure_of_another_class_does_not_break_a_streak() -> None:
    r = rig()
    r.fail("p0", C.TIMEOUT, 2)
    r.fail("p0", C.INFERENCE_STATUS)
    r.fail("p0", C.OVERLOAD)
    assert r.actions == []
    r.fail("p0", C.TIMEOUT)
    assert r.actions == [("p0", C.TIMEOUT, Action.HEALTH_PROBE, "x")]


def test_a_clearing_success_on_one_engine_leaves_its_peers_alone() -> None:
    r = rig(eject_after=100)
    for engine_id in ("p0", "p1", "d0"):
        r.fail(engine_id, C.CONNECTION, 2)
    r.recorder.success("p0", SuccessKind.HEALTH_OK, "health")
    assert r.streaks("p0") == {}
    assert r.streaks("p1") == {C.CONNECTION: 2}
    assert r.streaks("d0") == {C.CONNECTION: 2}


# --------------------------------------------------------------------------- clearing table
@pytest.mark.parametrize("kind", list(CLEARING))
def test_each_row_of_the_clearing_table_clears_exactly_its_classes(kind: SuccessKind) -> None:
    r = rig(eject_after=100)
    for cls in FailureClass:
        r.fail("p0", cls, 2)
        r.fail("p1", cls, 2)
    r.fleet.apply(LivenessSwept("p0", silent=True), 0.0)
    assert r.fleet.get("p0").liveness_misses == 1
    r.recorder.success("p0", kind, "test")
    kept = ALL - CLEARING[kind]
    assert r.streaks("p0") == {cls: 2 for cls in kept}
    for cls in FailureClass:
        assert r.gauge("p0", cls) == (2 if cls in kept else 0)
    # nothing else: the peer's evidence, and no action fired
    assert r.streaks("p1") == {cls: 2 for cls in FailureClass}
    assert r.actions == []
    if kind is not SuccessKind.HEALTH_OK:
        assert r.fleet.get("p0").liveness_misses == 1


@pytest.mark.parametrize("kind", list(CLEARING))
def test_a_success_with_nothing_recorded_is_harmless(kind: SuccessKind) -> None:
    r = rig()
    r.recorder.success("p0", kind, "test")
    assert r.streaks("p0") == {}


@pytest.mark.parametrize("kind", list(CLEARING))
def test_a_cleared_streak_starts_over(kind: SuccessKind) -> None:
    r = rig()
    for cls in CLEARING[kind]:
        r.fail("p0", cls, EJECT_AFTER - 1)
    r.recorder.success("p0", kind, "test")
    for cls in CLEARING[kind]:
        r.fail("p0", cls, EJECT_AFTER - 1)
    assert r.actions == []
    assert r.streaks("p0") == {cls: EJECT_AFTER - 1 for cls in CLEARING[kind]}


def test_client_4xx_clears_connection_and_inference_status_only() -> None:
    r = rig(eject_after=100)
    for cls in FailureClass:
        r.fail("d0", cls)
    r.recorder.success("d0", SuccessKind.CLIENT_4XX, "decode")
    assert r.streaks("d0") == {
        C.TIMEOUT: 1,
        C.STREAM: 1,
        C.OVERLOAD: 1,
        C.KV_HANDOFF: 1,
    }


def test_a_passed_inference_probe_clears_only_the_inference_classes() -> None:
    r = rig(eject_after=100)
    for cls in FailureClass:
        r.fail("p0", cls)
    r.fleet.apply(InferenceVerified("p0", "probe passed"), 0.0)
    assert set(r.streaks("p0")) == ALL - {C.STREAM, C.INFERENCE_STATUS, C.KV_HANDOFF}


# --------------------------------------------------------------------------- actions
@pytest.mark.parametrize("cls", list(FailureClass))
@pytest.mark.parametrize("eject_after", [1, 2, 3, 5])
def test_the_action_fires_when_the_streak_reaches_eject_after(
    cls: FailureClass, eject_after: int
) -> None:
    r = rig(eject_after)
    for n in range(1, eject_after):
        r.fail("p0", cls, detail=f"failure {n}")
        assert r.actions == [], f"fired at streak {n} < {eject_after}"
    r.fail("p0", cls, detail="the last straw")
    assert r.actions == [("p0", cls, ACTIONS[cls], "the last straw")]


@pytest.mark.parametrize("cls", list(FailureClass))
def test_action_for_is_the_spec_table(cls: FailureClass) -> None:
    assert action_for(cls, EJECT_AFTER - 1, EJECT_AFTER) is Action.NONE
    assert action_for(cls, EJECT_AFTER, EJECT_AFTER) is ACTIONS[cls]


def test_every_handler_hears_the_effect() -> None:
    r = rig(eject_after=1)
    heard: list[Any] = []
    r.recorder.on_effect(heard.append)
    r.fail("d0", C.TIMEOUT, detail="slow")
    assert r.actions == [("d0", C.TIMEOUT, Action.HEALTH_PROBE, "slow")]
    assert heard == [SuspectProbe("d0", C.TIMEOUT)]


def test_a_streak_on_another_engine_does_not_fire_for_this_one() -> None:
    r = rig()
    r.fail("p0", C.CONNECTION, EJECT_AFTER - 1)
    r.fail("p1", C.CONNECTION, EJECT_AFTER - 1)
    assert r.actions == []
    r.fail("p1", C.CONNECTION)
    assert [a[0] for a in r.actions] == ["p1"]


# --------------------------------------------------------------------------- router wiring
def test_router_ejects_on_a_connection_streak() -> None:
    clock = FakeClock()
    router = Router(config(eject_after=2, failure_quarantine_s=20), clock=clock)
    verify_all(router.fleet)
    router.evidence.failure("p0", EngineFailure(C.CONNECTION, "refused"), "prefill")
    assert router.fleet.get("p0").ejected is None
    router.evidence.failure("p0", EngineFailure(C.CONNECTION, "refused"), "prefill")
    p0 = router.fleet.get("p0")
    assert p0.ejected is not None
    assert p0.ejected.cause == "connection"
    assert p0.ejected.evidence == {"connection": 2}
    quarantine = p0.holds[HoldName.FAILURE_QUARANTINE]
    assert quarantine.deadline_mono == clock.monotonic() + 20


@pytest.mark.parametrize("cls", [C.STREAM, C.INFERENCE_STATUS, C.KV_HANDOFF])
def test_router_pauses_new_requests_on_an_inference_streak(cls: FailureClass) -> None:
    clock = FakeClock()
    router = Router(config(eject_after=2), clock=clock)
    verify_all(router.fleet)
    for _ in range(2):
        router.evidence.failure("p0", EngineFailure(cls, "bad"), "prefill")
    p0 = router.fleet.get("p0")
    assert p0.ejected is None
    assert set(p0.holds) == {HoldName.INFERENCE_VERIFICATION}
    assert p0.holds[HoldName.INFERENCE_VERIFICATION].deadline_mono is None
    assert [c.id for c in router.fleet.candidates(p0.role, clock.monotonic())] == ["p1"]


# --------------------------------------------------------------------------- liveness column
class FakeEngine:
    """A loopback HTTP/1.1 engine: `ok` answers 200, `drop` closes without a response."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.requests.append(head.split(b"\r\n", 1)[0])
            if self.mode == "ok":
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@dataclass
class Live:
    router: Router
    clock: FakeClock
    engine: FakeEngine

    def p0(self) -> EngineState:
        """p0's current state (a state read earlier is stale after any change)."""
        return self.router.fleet.get("p0")

    async def sweep(self) -> None:
        """The health and liveness stages of one monitor pass."""
        now = self.clock.monotonic()
        await self.router.health.health(now)
        await self.router.health.liveness(now)
        self.clock.advance(1.0)


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    engine = FakeEngine()
    url = await engine.start()
    cfg = parse_config(
        {
            "model": "demo-model",
            "engines": [
                {"id": "p0", "url": url, "role": "prefill"},
                {"id": "d0", "url": "http://127.0.0.1:9", "role": "decode"},
            ],
            "engine": {"health_timeout_s": 5.0},
            "recovery": {"eject_after": 100, "liveness_misses": 3},
            "handoff": {"path": str(tmp_path / "handoff.json")},
        }
    )
    clock = FakeClock()
    router = Router(cfg, clock=clock)
    verify_all(router.fleet)
    await router.client.start()
    try:
        yield Live(router, clock, engine)
    finally:
        await router.client.close()
        await engine.close()


async def test_health_200_in_a_sweep_resets_the_liveness_counter(live: Live) -> None:
    live.engine.mode = "drop"
    await live.sweep()
    await live.sweep()
    assert live.p0().liveness_misses == 2
    assert live.p0().evidence == {C.CONNECTION: 2}
    live.engine.mode = "ok"
    await live.sweep()
    assert live.p0().liveness_misses == 0
    assert live.p0().evidence == {}
    live.engine.mode = "drop"
    await live.sweep()
    assert live.p0().liveness_misses == 1
    assert live.p0().ejected is None


async def test_liveness_misses_eject_after_consecutive_silent_sweeps(live: Live) -> None:
    live.engine.mode = "drop"
    for _ in range(3):
        await live.sweep()
    p0 = live.p0()
    assert p0.ejected is not None
    assert p0.ejected.cause == "liveness"


async def test_suspect_probe_200_clears_timeout_and_overload_evidence(live: Live) -> None:
    now = live.clock.monotonic()
    for cls, times in ((C.TIMEOUT, 3), (C.OVERLOAD, 1), (C.STREAM, 1)):
        for _ in range(times):
            live.router.fleet.apply(LegFailed("p0", cls, "x", "test"), now)
    assert live.p0().evidence == {C.TIMEOUT: 3, C.OVERLOAD: 1, C.STREAM: 1}
    await live.router.suspects.probe("p0", C.TIMEOUT)
    assert live.p0().ejected is None
    assert live.p0().evidence == {C.STREAM: 1}


async def test_suspect_probe_200_resets_the_liveness_counter(live: Live) -> None:
    live.engine.mode = "drop"
    await live.sweep()
    await live.sweep()
    assert live.p0().liveness_misses == 2
    # a timeout streak makes the router run a suspect health probe; the engine answers 200
    live.engine.mode = "ok"
    await live.router.suspects.probe("p0", C.TIMEOUT)
    assert live.p0().ejected is None
    assert live.p0().liveness_misses == 0
    # one silent sweep after a successful health response is one miss, not three
    live.engine.mode = "drop"
    await live.sweep()
    assert live.p0().ejected is None
    assert live.p0().liveness_misses == 1
