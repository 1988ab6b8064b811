"""Inference probes, holds and failure quarantine on a fake clock (spec "Failure evidence",
"Failure quarantine", "Last-engine protection"; DESIGN §2).

The router is real (evidence, lifecycle, readiness, the probe's decisions); only the engine
legs are fakes: `FakeLegs` answers each prefill or decode leg well or with a 500 per engine, so
probes conclude without sockets. The HTTP legs themselves are covered end to end in
tests/e2e/test_failures_*.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from narwhal.clock import FakeClock
from narwhal.config import Config, Role, parse_config
from narwhal.control.engine_tasks import EngineTasks
from narwhal.control.probes import InferenceProber, ProbeResult, Verdict
from narwhal.engine.adapter import PrefillReply
from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.fleet.holds import HoldName
from narwhal.fleet.state import EngineState
from narwhal.server import Router
from tests.support.fleet import collecting_tasks, set_in_flight, verify_all

C = FailureClass
IV = HoldName.INFERENCE_VERIFICATION
FQ = HoldName.FAILURE_QUARANTINE
EJECT_AFTER = 2
TARGETS = ("held", "ejected", "in-service")


@dataclass
class FakeLegs:
    """A fake adapter: prefill legs yield a handoff, decode legs open; engines listed in
    `prefill_fails` / `decode_fails` answer their leg with HTTP 500 instead."""

    prefill_fails: set[str] = field(default_factory=set)
    decode_fails: set[str] = field(default_factory=set)
    legs: list[tuple[str, str]] = field(default_factory=list)

    async def prefill(self, pool: object, engine: Any, *args: Any) -> PrefillReply:
        self.legs.append(("prefill", engine.id))
        if engine.id in self.prefill_fails:
            return PrefillReply(500, b"{}", "application/json")
        return PrefillReply(200, b"{}", "application/json", {}, f"handoff-of-{engine.id}")

    @asynccontextmanager
    async def decode(self, pool: object, engine: Any, *args: Any) -> AsyncIterator[dict[str, Any]]:
        yield {}

    async def discard(self, producer: object, handoff: object) -> None:
        return None

    def recomputed(self, final: bytes | None) -> str | None:
        return None


class FakeProber(InferenceProber):
    """The real prober with its streamed leg answered by `FakeLegs` instead of a socket."""

    legs: FakeLegs

    async def decode_leg(self, engine: EngineState, body: dict[str, Any]) -> bytes | None:
        self.legs.legs.append(("decode", engine.id))
        if engine.id in self.legs.decode_fails:
            raise EngineFailure(C.INFERENCE_STATUS, "decode leg answered HTTP 500", status=500)
        return b'{"choices": []}'


def config(prefill: int = 1, decode: int = 1, **recovery: Any) -> Config:
    engines = [
        {"id": f"{prefix}{i}", "url": f"http://127.0.0.1:{port + i}", "role": role}
        for role, count, prefix, port in (
            ("prefill", prefill, "p", 9001),
            ("decode", decode, "d", 9101),
        )
        for i in range(count)
    ]
    return parse_config(
        {
            "model": "demo-model",
            "engines": engines,
            "recovery": {"eject_after": EJECT_AFTER, **recovery},
        }
    )


@dataclass
class Rig:
    router: Router
    clock: FakeClock
    prober: FakeProber
    legs: FakeLegs
    spawned: list[asyncio.Task[None]] = field(default_factory=list)
    tasks: EngineTasks = field(init=False)

    def __post_init__(self) -> None:
        self.tasks = collecting_tasks(self.spawned)

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def e(self, engine_id: str) -> EngineState:
        return self.router.fleet.get(engine_id)

    def fail(self, engine_id: str, cls: FailureClass, times: int = EJECT_AFTER) -> None:
        for _ in range(times):
            self.router.evidence.failure(engine_id, EngineFailure(cls, "HTTP 500"), "test")

    def holds(self, engine_id: str) -> set[HoldName]:
        return self.e(engine_id).active_holds_by_name(self.now)

    def schedule(self) -> int:
        """One monitor pass's probe scheduling; returns how many probes it started."""
        before = len(self.spawned)
        self.prober.schedule(self.tasks)
        return len(self.spawned) - before

    async def run_probes(self) -> None:
        """Let every started probe conclude (each applies its own result)."""
        probes = list(self.spawned)
        self.spawned.clear()  # the same list the tasks append to
        await asyncio.gather(*probes)

    def metric(self, name: str, **labels: str) -> float:
        value = self.router.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def probes(self, engine_id: str, result: str) -> float:
        return self.metric(
            "narwhal_probes_total", engine=engine_id, kind="inference", result=result
        )


def rig(cfg: Config | None = None) -> Rig:
    cfg = cfg or config()
    clock = FakeClock()
    router = Router(cfg, clock=clock)
    verify_all(router.fleet)  # a serving fleet, already seen healthy
    legs = FakeLegs()
    prober = FakeProber(
        cfg,
        router.fleet,
        router.client,  # never started: the fake legs make no requests
        router.lifecycle,
        router.metrics,
        clock,
        lambda engine: legs,  # type: ignore[arg-type, return-value]
    )
    prober.legs = legs
    return Rig(router, clock, prober, legs)


# ------------------------------------------------------------------ two suspects, no peers
async def test_the_only_prefill_and_decode_engines_held_verify_each_other() -> None:
    """Both engines hold inference_verification: neither has an eligible peer, so each probe
    takes the other suspect as its peer; the passing round trips clear both holds."""
    r = rig()
    r.fail("p0", C.INFERENCE_STATUS)
    r.fail("d0", C.STREAM)
    assert r.holds("p0") == {IV} and r.holds("d0") == {IV}
    assert r.router.ready() == "no capacity: prefill"
    assert r.prober.peer(Role.DECODE, r.e("p0")) is r.e("d0")
    assert r.prober.peer(Role.PREFILL, r.e("d0")) is r.e("p0")

    assert r.schedule() == 2
    await r.run_probes()
    for engine_id in ("p0", "d0"):
        assert r.holds(engine_id) == set(), engine_id
        assert r.e(engine_id).evidence == {}, engine_id
        assert r.e(engine_id).ejected is None
        assert r.prober.last[engine_id].verdict is Verdict.OK
    assert r.prober.last["p0"].peer == "d0" and r.prober.last["d0"].peer == "p0"
    assert r.router.ready() is None
    assert r.schedule() == 0  # nothing left to verify


async def test_one_passing_probe_clears_a_held_peer_too() -> None:
    r = rig()
    r.fail("p0", C.INFERENCE_STATUS)
    r.fail("d0", C.STREAM)
    await r.prober._probe_and_apply(r.e("p0"))  # only p0's probe runs
    assert r.holds("p0") == set() and r.holds("d0") == set()
    assert r.e("d0").evidence == {}
    assert r.probes("p0", "ok") == 1
    assert r.probes("d0", "ok") == 0  # d0 was never probed itself


async def test_a_held_peer_failing_its_leg_is_charged_only_in_its_own_probe() -> None:
    """d0's decode legs fail. In p0's probe that leg is d0's, not p0's: inconclusive for p0.
    In d0's own probe it ejects d0; p0 then has no peer at all and stays held."""
    r = rig()
    r.legs.decode_fails.add("d0")
    r.fail("p0", C.INFERENCE_STATUS)
    r.fail("d0", C.INFERENCE_STATUS)

    p0_result = await r.prober.probe(r.e("p0"))
    assert p0_result.verdict is Verdict.INCONCLUSIVE
    assert "d0" in p0_result.reason
    await r.prober._probe_and_apply(r.e("d0"))
    assert r.prober.last["d0"].verdict is Verdict.FAILED
    assert r.e("d0").ejected is not None
    assert r.e("d0").ejected.cause == "inference_status"

    r.prober.apply(r.e("p0"), p0_result, r.now)
    assert r.e("p0").ejected is None and r.holds("p0") == {IV}
    assert r.prober.peer(Role.DECODE, r.e("p0")) is None  # an ejected engine stands in for none
    assert r.schedule() == 1
    await r.run_probes()
    assert r.prober.last["p0"].verdict is Verdict.INCONCLUSIVE
    assert r.prober.last["p0"].reason == "no healthy decode peer"
    assert r.holds("p0") == {IV}


async def test_a_prefill_failing_its_own_leg_with_a_held_peer_is_ejected() -> None:
    r = rig()
    r.legs.prefill_fails.add("p0")
    r.fail("p0", C.INFERENCE_STATUS)
    r.fail("d0", C.STREAM)
    assert r.schedule() == 2
    await r.run_probes()
    assert r.prober.last["p0"].verdict is Verdict.FAILED
    assert r.e("p0").ejected is not None
    # d0's probe needed p0's handoff, which p0 failed to produce: inconclusive for d0.
    assert r.prober.last["d0"].verdict is Verdict.INCONCLUSIVE
    assert r.e("d0").ejected is None and r.holds("d0") == {IV}


@pytest.mark.parametrize("other", [HoldName.OPERATOR_DRAIN, HoldName.PLANNED_MAINTENANCE])
def test_a_drained_suspect_never_stands_in_as_a_peer(other: HoldName) -> None:
    r = rig()
    r.fail("d0", C.STREAM)
    r.router.lifecycle.hold(r.e("d0"), other, "operator", r.now)
    assert r.prober.peer(Role.DECODE, r.e("p0")) is None


def test_an_eligible_peer_is_preferred_over_a_held_one() -> None:
    r = rig(config(decode=2))
    r.fail("d0", C.STREAM)
    set_in_flight(r.router.fleet, "d1", 5)  # busier than d0, and still the one chosen
    assert r.prober.peer(Role.DECODE, r.e("p0")) is r.e("d1")


def test_a_quarantined_held_suspect_still_stands_in_as_a_peer() -> None:
    """Quarantine is soft: it does not stop a suspect from verifying its peer."""
    r = rig(config(failure_quarantine_s=60))
    r.fail("d0", C.STREAM)
    assert r.holds("d0") == {IV, FQ}
    assert r.prober.peer(Role.DECODE, r.e("p0")) is r.e("d0")


# ------------------------------------------------------------------ quarantine clearing
def test_a_probe_type_action_adds_quarantine_with_the_configured_deadline() -> None:
    r = rig(config(decode=2, failure_quarantine_s=45))
    r.clock.advance(3)
    start, wall = r.now, r.clock.wall()
    r.fail("d0", C.KV_HANDOFF, EJECT_AFTER - 1)
    assert r.holds("d0") == set()  # below the threshold: nothing
    r.fail("d0", C.KV_HANDOFF, 1)
    assert r.holds("d0") == {IV, FQ}
    assert r.e("d0").ejected is None
    q = r.e("d0").holds[FQ]
    assert (q.deadline_mono, q.deadline_wall) == (start + 45, wall + 45)
    assert "kv_handoff streak" in q.reason


@pytest.mark.parametrize("cls", [C.TIMEOUT, C.OVERLOAD])
def test_a_health_probe_action_adds_quarantine_and_health_200_clears_it_early(
    cls: FailureClass,
) -> None:
    r = rig(config(decode=2, failure_quarantine_s=45))
    r.fail("d1", cls)
    assert r.holds("d1") == {FQ}
    assert r.e("d1").holds[FQ].deadline_mono == r.now + 45
    assert sorted(c.id for c in r.router.fleet.candidates(Role.DECODE, r.now)) == ["d0"]
    r.clock.advance(10)  # long before the deadline
    r.router.lifecycle.health_ok(r.e("d1"), r.now)
    assert r.holds("d1") == set()
    assert sorted(c.id for c in r.router.fleet.candidates(Role.DECODE, r.now)) == ["d0", "d1"]


def test_without_quarantine_configured_a_probe_action_adds_only_the_hold() -> None:
    r = rig(config(decode=2))
    r.fail("d0", C.STREAM)
    assert r.holds("d0") == {IV}
    r.fail("d1", C.TIMEOUT)
    assert r.holds("d1") == set()


def test_a_passing_inference_probe_clears_hold_and_quarantine_before_the_deadline() -> None:
    """The issue's "early clearing by inference success": apply(OK) on a held, quarantined
    engine releases both holds and the inference evidence, long before the deadline."""
    r = rig(config(decode=2, failure_quarantine_s=300))
    r.fail("d0", C.STREAM)
    r.fail("d0", C.TIMEOUT, 1)  # not an inference class: a passing probe leaves it
    assert r.holds("d0") == {IV, FQ}
    r.clock.advance(5)
    r.prober.apply(r.e("d0"), ProbeResult(Verdict.OK, "decode leg ok"), r.now)
    assert r.e("d0").holds == {}
    assert r.e("d0").evidence == {C.TIMEOUT: 1}
    assert r.router.fleet.eligible(r.e("d0"), r.now)
    assert r.probes("d0", "ok") == 1


def test_a_quarantine_left_alone_expires_at_its_deadline_through_selection() -> None:
    r = rig(config(decode=2, failure_quarantine_s=30))
    r.fail("d0", C.STREAM)
    r.prober.apply(r.e("d0"), ProbeResult(Verdict.INCONCLUSIVE, "no peer"), r.now)
    r.router.lifecycle.release(r.e("d0"), IV, "test", r.now)  # only the quarantine is left
    r.clock.advance(29.9)
    assert not r.router.fleet.eligible(r.e("d0"), r.now)
    r.clock.advance(0.1)
    assert r.router.fleet.eligible(r.e("d0"), r.now)


# ------------------------------------------------------------------ inconclusive probes
async def test_an_inconclusive_probe_keeps_the_hold_and_the_next_pass_probes_again() -> None:
    r = rig(config(decode=2, failure_quarantine_s=60))
    r.fail("d0", C.STREAM)
    r.router.lifecycle.eject(r.e("p0"), "connection", "refused", r.now)  # no prefill peer
    evidence = dict(r.e("d0").evidence)

    assert r.schedule() == 1
    assert r.schedule() == 0  # one probe per engine at a time
    await r.run_probes()
    assert r.prober.last["d0"] == ProbeResult(Verdict.INCONCLUSIVE, "no healthy prefill peer")
    assert r.holds("d0") == {IV, FQ}
    assert r.e("d0").evidence == evidence
    assert r.e("d0").ejected is None
    assert [c.id for c in r.router.fleet.candidates(Role.DECODE, r.now)] == ["d1"]

    for n in (2, 3):
        r.clock.advance(1)
        assert r.schedule() == 1, "every pass reschedules the held engine"
        await r.run_probes()
        assert r.probes("d0", "inconclusive") == n
    assert r.holds("d0") == {IV, FQ}

    # Once a peer is back, the next scheduled probe concludes and clears both holds.
    r.router.lifecycle.readmit(r.e("p0"), "verified", r.now)
    assert r.schedule() == 1
    await r.run_probes()
    assert r.prober.last["d0"].verdict is Verdict.OK
    assert r.e("d0").holds == {}
    assert r.schedule() == 0


def test_schedule_skips_ejected_and_unheld_engines() -> None:
    r = rig(config(decode=2))
    r.fail("d0", C.STREAM)
    r.router.lifecycle.eject(r.e("d0"), "stream", "probe failed", r.now)
    r.fail("d1", C.TIMEOUT)
    assert r.schedule() == 0
    for coro in r.spawned:
        coro.close()


# ------------------------------------------------------------------ transitions metric
def test_transitions_are_counted_by_target_state() -> None:
    """`narwhal_engine_transitions_total{engine, to}`: to is `held`, `ejected` or
    `in-service` (docs/failure-handling.md); a change that leaves the state as it was is
    not a transition."""
    r = rig(config(decode=2))

    def total(engine_id: str, to: str) -> float:
        return r.metric("narwhal_engine_transitions_total", engine=engine_id, to=to)

    # The rig's verification (unverified -> in-service) is counted too: count from here.
    baseline = {(e.id, to): total(e.id, to) for e in r.router.fleet for to in TARGETS}

    def count(to: str, engine_id: str = "d0") -> float:
        return total(engine_id, to) - baseline[(engine_id, to)]

    r.fail("d0", C.STREAM)
    assert (count("held"), count("ejected"), count("in-service")) == (1, 0, 0)
    r.router.lifecycle.hold(r.e("d0"), IV, "again", r.now)  # already held: no change
    assert count("held") == 1
    r.router.lifecycle.eject(r.e("d0"), "stream", "probe failed", r.now)
    assert (count("held"), count("ejected"), count("in-service")) == (1, 1, 0)
    r.router.lifecycle.readmit(r.e("d0"), "verified", r.now)
    assert (count("held"), count("ejected"), count("in-service")) == (1, 1, 1)
    r.router.lifecycle.release(r.e("d0"), IV, "nothing held", r.now)
    assert count("in-service") == 1
    assert count("held", "d1") == 0
