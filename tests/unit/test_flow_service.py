"""Flow control's service in the control process (`control/flow.py`), on a fake clock, with
the fleet's room as a value the test sets: a router that stops admitting starts nothing it
held, and what `/admin/flow` counts (refusals by reason and by key, tokens by key)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from narwhal.clock import FakeClock
from narwhal.config import Config
from narwhal.control.flow import FlowService
from narwhal.fleet.admission import Admission
from narwhal.fleet.events import HoldRequested, Readmitted, VerificationSeen
from narwhal.fleet.holds import HoldName
from narwhal.fleet.store import Fleet
from narwhal.flow.messages import (
    Ask,
    Begun,
    Done,
    FlowEffect,
    Kept,
    Preempt,
    Refuse,
    Requeue,
    Start,
)
from narwhal.telemetry.metrics import FlowMetrics

KEY = "a" * 12  # a key's label


class Harness:
    def __init__(self, **sections: Any) -> None:
        base: dict[str, Any] = {
            "model": "m",
            "engines": [{"id": "e0", "url": "http://10.0.0.1:8000", "role": "both"}],
            "serving": {"policy": "bounded"},
        }
        config = Config.model_validate({**base, **sections})
        clock = self.clock = FakeClock()
        self.admission = Admission()
        self.service = FlowService(
            config,
            Fleet(config.engines, clock),
            clock,
            self.admission,
            FlowMetrics(CollectorRegistry()),
            dict,
        )
        self.free = 1.0  # the role's free slots, as the fleet would say
        self.service.room = lambda group: {"both": self.free}  # type: ignore[method-assign]
        self.answers: list[FlowEffect] = []
        self.service.deliver = self.answers.append

    def ask(self, request_id: str, key: str | None = None) -> FlowEffect | None:
        before = len(self.answers)
        self.service.handle(Ask(request_id, "m", key or "", key, 0, 10, 20, 30.0))
        mine = [a for a in self.answers[before:] if a.id == request_id]
        return mine[0] if mine else None


def test_a_closed_admission_fences_before_a_freed_slot_starts_a_waiting_request() -> None:
    h = Harness()
    assert isinstance(h.ask("running"), Start)
    h.free = 0.0  # the running request holds the only slot
    assert h.ask("w1") is None and h.ask("w2") is None
    assert h.service.state.waiting() == 2
    h.admission.close("lease", "fenced: lease lost")
    h.answers.clear()
    h.free = 1.0  # the running request ends: its slot is free before the clock's next tick
    h.service.handle(Done("running", 4))
    assert not [a for a in h.answers if isinstance(a, Start)], h.answers
    refused = [a for a in h.answers if isinstance(a, Refuse)]
    assert sorted(a.id for a in refused) == ["w1", "w2"]
    assert {(a.status, a.retry_after_s, a.message) for a in refused} == {
        (503, 1, "not admitting requests: fenced: lease lost")
    }
    assert h.service.state.waiting() == 0 and len(h.service.state) == 0
    assert h.service.refused["not_admitted"] == 2


def test_an_open_admission_starts_the_next_waiting_request_when_a_slot_frees() -> None:
    h = Harness()
    assert isinstance(h.ask("running"), Start)
    h.free = 0.0
    assert h.ask("w1") is None
    h.free = 1.0
    h.service.handle(Done("running", 4))
    assert [type(a) for a in h.answers[-1:]] == [Start] and h.answers[-1].id == "w1"


def test_refusals_by_reason_rate_limits_by_key_and_served_tokens(monkeypatch: Any) -> None:
    monkeypatch.setenv("TEST_FLOW_SERVICE_KEYS", "sk-one")
    h = Harness(
        auth={
            "api_keys_env": "TEST_FLOW_SERVICE_KEYS",
            "key_policies": {KEY: {"requests_per_minute": 1}},
        }
    )
    h.free = 10.0
    assert isinstance(h.ask("r1", KEY), Start)
    refused = h.ask("r2", KEY)
    assert isinstance(refused, Refuse) and refused.reason == "requests_per_minute"
    assert isinstance(h.ask("other", "b" * 12), Start)  # another key: no limit
    h.service.handle(Done("r1", 7))
    assert h.service.refused_by_key == {KEY: {"requests_per_minute": 1}}
    assert h.service.refused["requests_per_minute"] == 1
    assert h.service.refused["queue_full"] == 0  # every reason shows, counted or not
    assert h.service.served_tokens == {KEY: 7}


def test_queue_refusals_are_counted_by_key_too() -> None:
    """A keyed request shed from a full queue, or past its deadline, counts under its key as
    a rate-limit refusal does: an operator sees which client the overload turned away."""
    h = Harness(flow={"queue_limit": 1})
    assert isinstance(h.ask("running"), Start)
    h.free = 0.0
    assert h.ask("w1", KEY) is None  # waits: the queue's one place
    shed = h.ask("w2", "b" * 12)  # the newcomer, as served (nothing yet) and as low: refused
    assert isinstance(shed, Refuse) and shed.reason == "queue_full"
    assert h.service.refused_by_key == {"b" * 12: {"queue_full": 1}}
    h.clock.advance(31.0)  # past the ask's wait of 30 s
    h.service.tick()
    assert [(a.id, a.reason) for a in h.answers[-1:] if isinstance(a, Refuse)] == [
        ("w1", "deadline")
    ]
    assert h.service.refused_by_key == {"b" * 12: {"queue_full": 1}, KEY: {"deadline": 1}}


def _pd_service(**engine: Any) -> tuple[FlowService, Fleet]:
    config = Config.model_validate(
        {
            "model": "m",
            "engines": [
                {"id": "p0", "url": "http://10.0.0.1:8000", "role": "prefill"},
                {"id": "d0", "url": "http://10.0.0.2:8000", "role": "decode", **engine},
                {"id": "d1", "url": "http://10.0.0.3:8000", "role": "decode", **engine},
            ],
            "serving": {"policy": "bounded"},
            "flow": {"preempt_priority": 0},
        }
    )
    clock = FakeClock()
    fleet = Fleet(config.engines, clock)
    for engine_id in ("p0", "d0", "d1"):
        fleet.apply(Readmitted(engine_id, "test"), 0.0)
    metrics = FlowMetrics(CollectorRegistry())
    return FlowService(config, fleet, clock, Admission(), metrics, dict), fleet


def test_a_slot_freed_on_an_engine_nobody_may_use_frees_nothing() -> None:
    """Preemption asks a stream only for an engine among the role's candidates: one full
    by its count but drained by an operator would give its slot to nobody."""
    service, fleet = _pd_service(max_concurrency=1)
    fleet.in_flight.enter("d0")
    fleet.in_flight.enter("d1")
    assert service.frees("m", "decode", "d0") and service.frees("m", "decode", "d1")
    fleet.apply(HoldRequested("d1", HoldName.OPERATOR_DRAIN, "drain"), 0.0)
    assert service.frees("m", "decode", "d0") and not service.frees("m", "decode", "d1")
    assert not service.frees("m", "decode", "gone")


def test_kept_answered_inside_a_delivery_is_handled_after_it_not_within() -> None:
    """With one process a stream that cannot step aside answers `Kept` from inside the
    delivery of its `Preempt`: each is handled after the event being handled, in order, so
    a long run of such streams never nests one call per stream."""
    service, fleet = _pd_service(max_concurrency=1)
    fleet.in_flight.enter("d0")  # full by its count: a stream leaving it would free a slot
    streams = 400
    preempted: list[str] = []
    depth = [0, 0]  # now, deepest

    def deliver(effect: FlowEffect) -> None:
        if isinstance(effect, Preempt):
            preempted.append(effect.id)
            depth[0] += 1
            depth[1] = max(depth[1], depth[0])
            service.handle(Kept(effect.id))  # the data plane could not cut it
            depth[0] -= 1

    service.deliver = deliver  # type: ignore[method-assign]
    rooms = {"prefill": 8.0, "decode": float(streams)}
    service.room = lambda group: rooms  # type: ignore[method-assign]
    for i in range(streams):  # each through its prefill, decoding on d0
        service.handle(Ask(f"s{i}", "m", "c", None, 2, 10, 20, 30.0, preemptible=True))
        service.handle(Begun(f"s{i}", "prefill", "p0"))
        service.handle(Begun(f"s{i}", "decode", "d0"))
    rooms["decode"] = 0.0
    service.handle(Ask("urgent", "m", "c", None, 0, 10, 20, 30.0))
    assert len(preempted) == streams  # every stream asked once, none twice
    assert depth[1] == 1


def test_a_stream_stepping_aside_as_the_router_stops_admitting_is_answered_not_started() -> None:
    """It was asked to step aside; the lease was lost before its leg was off. Its slot is
    free when its Requeue comes, but a router that no longer admits starts nothing: it is
    answered 503 with the others."""
    h = Harness(flow={"preempt_priority": 0})
    h.service.state.preemptions.frees = lambda group, role, engine_id: True
    h.service.handle(Ask("s", "m", "c", None, 2, 10, 20, 30.0, preemptible=True))
    h.service.handle(Begun("s", "both", "e0"))
    h.free = 0.0
    assert h.ask("urgent") is None  # priority 0: waits, and asks s to step aside
    assert [a.id for a in h.answers if isinstance(a, Preempt)] == ["s"]
    h.admission.close("lease", "fenced: lease lost")
    h.answers.clear()
    h.free = 1.0  # s's leg is off: its slot is free
    h.service.handle(Requeue("s"))
    assert not [a for a in h.answers if isinstance(a, Start)], h.answers
    assert sorted(a.id for a in h.answers if isinstance(a, Refuse)) == ["s", "urgent"]
    assert len(h.service.state) == 0


def test_two_models_share_a_role_while_an_eligible_engine_of_it_serves_both() -> None:
    """A LoRA adapter served by one decode engine: the adapter and the base model compete
    for that engine's decode slots (flow/state.py counts each one's unplaced grants against
    the other), not for the prefill engine that serves the base model alone."""
    service, fleet = _pd_service()
    fleet.apply(VerificationSeen("d0", True, "models", models=("m", "adapter")), 0.0)
    assert service.shares("m", "adapter", "decode") and service.shares("adapter", "m", "decode")
    assert not service.shares("m", "adapter", "prefill")
    fleet.apply(HoldRequested("d0", HoldName.OPERATOR_DRAIN, "drain"), 0.0)
    assert not service.shares("m", "adapter", "decode")  # d0 takes nobody's new work
