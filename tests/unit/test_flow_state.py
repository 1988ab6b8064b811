"""Flow control's step (flow/state.py): grants bounded by free slots less unplaced grants,
priority order, shedding, deadlines, rate limits, a worker's loss, fencing and resizing."""

from __future__ import annotations

import math
from collections.abc import Mapping

from narwhal.config import KeyPolicy
from narwhal.flow.messages import (
    Ask,
    Begun,
    Done,
    Fence,
    Refuse,
    Resize,
    Start,
    Tick,
    Withdraw,
    WorkerLost,
)
from narwhal.flow.saturation import EngineView, FlowLimits
from narwhal.flow.state import FlowState, Headroom, free_slots

LABEL = "0123456789ab"


class Fleet:
    """A fake fleet: per role, free slots (what the data plane's in-flight leaves)."""

    def __init__(self, prefill: float = 1, decode: float = 1) -> None:
        self.free = {"prefill": prefill, "decode": decode}

    def __call__(self, group: str) -> Mapping[str, float]:
        return dict(self.free)


def policies(**by_label: KeyPolicy) -> FlowState:
    table = dict(by_label)
    return FlowState(4, lambda label: table.get(label or "", table.get("default", KeyPolicy())))


def ask(i: int, priority: int = 0, client: str = "c", wait_s: float = 10.0, **kw: object) -> Ask:
    fields: dict[str, object] = {
        "id": f"r{i}", "group": "m", "client": client, "key": None, "priority": priority,
        "tokens": 10, "rate_tokens": 20, "wait_s": wait_s,
    }  # fmt: skip
    fields.update(kw)
    return Ask(**fields)  # type: ignore[arg-type]


def ids(effects: list[Start | Refuse], kind: type) -> list[str]:
    return [e.id for e in effects if isinstance(e, kind)]


def test_free_slots_sums_engines_with_room_and_is_unbounded_without_a_limit() -> None:
    limits = FlowLimits()
    assert free_slots([EngineView("a", 1, 4), EngineView("b", 4, 4)], limits) == 3
    assert free_slots([EngineView("a", 9, None)], limits) == math.inf
    assert free_slots([EngineView("a", 0, 4, waiting=99)], limits) == 0
    assert free_slots([], limits) == 0


def test_a_burst_is_granted_only_up_to_free_slots_until_legs_are_placed() -> None:
    state, fleet = policies(), Fleet(prefill=2, decode=2)
    out = [e for i in range(4) for e in state.step(ask(i), 0.0, fleet)]
    assert ids(out, Start) == ["r0", "r1"]
    assert state.waiting() == 2
    # r0's prefill is placed: the data plane counts it now (free 1), nothing new starts.
    fleet.free["prefill"] = 1
    assert state.step(Begun("r0", "prefill"), 0.1, fleet) == []
    # r0 ends and both its slots are free again: the queue's head starts.
    fleet.free = {"prefill": 1, "decode": 1}
    assert ids(state.step(Begun("r0", "decode"), 0.2, fleet), Start) == []
    fleet.free = {"prefill": 2, "decode": 2}
    # r0 ends: two free, one held by r1's grant, whose legs are not placed yet.
    assert ids(state.step(Done("r0", output_tokens=5), 0.3, fleet), Start) == ["r2"]
    assert ids(state.step(Withdraw("r1"), 0.4, fleet), Start) == ["r3"]


def test_priority_first_then_arrival_and_a_newcomer_waits_its_turn() -> None:
    state, fleet = policies(), Fleet(0, 0)
    for i, priority in enumerate([2, 1, 0, 1]):
        assert state.step(ask(i, priority), 0.0, fleet) == []
    fleet.free = {"prefill": 1, "decode": 1}
    started = []
    for t in range(4):
        out = state.step(Tick(), 1.0 + t, fleet)
        started += ids(out, Start)
        for request_id in ids(out, Start):
            state.step(Done(request_id), 1.0 + t, Fleet(0, 0))
    assert started == ["r2", "r1", "r3", "r0"]


def test_headroom_keeps_the_last_slots_for_urgent_requests() -> None:
    """With `headroom_slots: 1`, a less urgent request starts only while two slots are free:
    the last one waits for priority 0 (or more urgent), which takes it at once on arrival."""
    state, fleet = policies(), Fleet(2, 2)
    state.headroom = Headroom(slots=1, priority=0)
    assert ids(state.step(ask(0, priority=1), 0.0, fleet), Start) == ["r0"]
    fleet.free = {"prefill": 1, "decode": 1}  # r0 placed: one slot left
    assert state.step(Begun("r0", "prefill"), 0.0, fleet) == []
    assert state.step(Begun("r0", "decode"), 0.0, fleet) == []
    assert state.step(ask(1, priority=1), 0.0, fleet) == []  # waits: the last slot is kept
    assert ids(state.step(ask(2, priority=-1), 0.0, fleet), Start) == ["r2"]  # more urgent
    fleet.free = {"prefill": 0, "decode": 0}
    state.step(Begun("r2", "prefill"), 0.0, fleet)
    state.step(Begun("r2", "decode"), 0.0, fleet)
    fleet.free = {"prefill": 1, "decode": 1}  # r0 ends: still only the kept slot
    assert state.step(Done("r0"), 1.0, fleet) == []
    assert ids(state.step(ask(3, priority=0), 1.0, fleet), Start) == ["r3"]
    fleet.free = {"prefill": 0, "decode": 0}
    state.step(Begun("r3", "prefill"), 1.0, fleet)
    state.step(Begun("r3", "decode"), 1.0, fleet)
    fleet.free = {"prefill": 2, "decode": 2}  # two free: the waiting r1 may start
    assert ids(state.step(Tick(), 2.0, fleet), Start) == ["r1"]
    # Without headroom (the default), every slot is anyone's.
    plain, fleet = policies(), Fleet(1, 1)
    assert ids(plain.step(ask(4, priority=2), 0.0, fleet), Start) == ["r4"]


def test_a_full_queue_refuses_the_worst_with_429_and_retry_after() -> None:
    state, fleet = policies(), Fleet(0, 0)
    for i in range(4):
        state.step(ask(i, priority=1, client=f"c{i}"), 0.0, fleet)
    [refused] = state.step(ask(9, priority=5), 0.0, fleet)  # worse than all: itself
    assert isinstance(refused, Refuse)
    assert (refused.id, refused.status, refused.reason, refused.code) == (
        "r9", 429, "queue_full", "rate_limit_exceeded",
    )  # fmt: skip
    assert refused.retry_after_s is not None and refused.retry_after_s >= 1
    [shed] = state.step(ask(10, priority=0), 0.0, fleet)  # better: the newest worst goes
    assert isinstance(shed, Refuse) and shed.id == "r3"
    assert state.waiting() == 4


def test_a_request_that_cannot_start_in_time_is_answered_at_its_deadline() -> None:
    state, fleet = policies(), Fleet(0, 0)
    state.step(ask(0, wait_s=2.0), 0.0, fleet)
    assert state.next_deadline() == 2.0
    assert state.step(Tick(), 1.9, fleet) == []
    [refused] = state.step(Tick(), 2.0, fleet)
    assert isinstance(refused, Refuse) and refused.reason == "deadline" and refused.waited_s == 2.0
    assert len(state) == 0


def test_rate_limits_refuse_with_headers_and_a_refusal_takes_nothing() -> None:
    state = policies(**{LABEL: KeyPolicy(requests_per_minute=2)})
    fleet = Fleet(math.inf, math.inf)
    keyed = {"key": LABEL, "client": LABEL}
    assert ids(state.step(ask(0, **keyed), 0.0, fleet), Start) == ["r0"]
    [second] = state.step(ask(1, **keyed), 0.0, fleet)
    assert isinstance(second, Start)
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    [third] = state.step(ask(2, **keyed), 0.0, fleet)
    assert isinstance(third, Refuse) and third.reason == "requests_per_minute"
    assert third.status == 429 and third.error_type == "requests"
    assert third.retry_after_s == 30  # one request back at 2 a minute
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert ids(state.step(ask(3, **keyed), 30.0, fleet), Start) == ["r3"]


def test_tokens_are_settled_at_done() -> None:
    state = policies(**{LABEL: KeyPolicy(tokens_per_minute=100)})
    fleet = Fleet(math.inf, math.inf)
    keyed = {"key": LABEL, "client": LABEL, "rate_tokens": 60}
    state.step(ask(0, **keyed), 0.0, fleet)
    [refused] = state.step(ask(1, **keyed), 0.0, fleet)  # 40 left
    assert isinstance(refused, Refuse) and refused.error_type == "tokens"
    state.step(Done("r0", output_tokens=5, prompt_tokens=5), 0.0, fleet)  # used 10 of 60
    assert ids(state.step(ask(2, **keyed), 0.0, fleet), Start) == ["r2"]


def test_a_lost_worker_takes_its_entries_and_grants_with_it() -> None:
    state, fleet = policies(), Fleet(1, 1)
    state.step(ask(0, worker=1), 0.0, fleet)  # granted, never placed
    state.step(ask(1, worker=1), 0.0, fleet)
    state.step(ask(2, worker=2), 0.0, fleet)
    assert state.unplaced("m", "decode") == 1
    out = state.step(WorkerLost(1), 0.5, fleet)
    assert ids(out, Start) == ["r2"]  # the grant no longer holds the slot
    assert "r1" not in state and "r0" not in state


def test_fencing_answers_every_waiting_request_503_at_once() -> None:
    state, fleet = policies(), Fleet(0, 0)
    for i in range(3):
        state.step(ask(i), 0.0, fleet)
    out = state.step(Fence("fenced: lease lost"), 1.0, fleet)
    assert [(e.id, e.status, e.retry_after_s) for e in out if isinstance(e, Refuse)] == [
        ("r0", 503, 1), ("r1", 503, 1), ("r2", 503, 1),
    ]  # fmt: skip
    assert out[0].message == "not admitting requests: fenced: lease lost"  # type: ignore[union-attr]
    assert state.waiting() == 0 and len(state) == 0


def test_resize_sheds_to_the_new_limit() -> None:
    state, fleet = policies(), Fleet(0, 0)
    for i in range(4):
        state.step(ask(i, client=f"c{i}"), 0.0, fleet)
    out = state.step(Resize(2), 0.0, fleet)
    assert len(ids(out, Refuse)) == 2 and state.waiting() == 2


def test_without_queueing_only_the_rate_limit_applies() -> None:
    state = policies()
    [start] = state.step(ask(0, queue=False), 0.0, Fleet(0, 0))
    assert isinstance(start, Start)
    state.step(Done("r0"), 0.0, Fleet(0, 0))
    assert len(state) == 0


def test_a_role_without_eligible_engines_does_not_hold_requests() -> None:
    state = policies()
    [start] = state.step(ask(0), 0.0, lambda group: {})
    assert isinstance(start, Start)


def test_a_grant_not_yet_placed_counts_against_every_model_sharing_its_engines() -> None:
    """Two models on the same engines (a base model and its LoRA adapters): a grant of one
    takes a slot the other's room still shows free until its leg is placed, so a burst over
    both models is never granted past the slots; models on separate engines are not held."""
    shared, fleet = policies(), Fleet(prefill=2, decode=1)
    shared.shares = lambda group, other, role: True
    out = [*shared.step(ask(0), 0.0, fleet), *shared.step(ask(1, group="lora"), 0.0, fleet)]
    assert ids(out, Start) == ["r0"] and shared.waiting() == 1
    shared.step(Begun("r0", "prefill", "p0"), 0.1, fleet)
    fleet.free["decode"] = 0
    assert shared.step(Begun("r0", "decode", "d0"), 0.1, fleet) == []
    fleet.free["decode"] = 1
    assert ids(shared.step(Done("r0", output_tokens=1), 0.2, fleet), Start) == ["r1"]

    apart, fleet = policies(), Fleet(prefill=2, decode=1)
    out = [*apart.step(ask(0), 0.0, fleet), *apart.step(ask(1, group="lora"), 0.0, fleet)]
    assert ids(out, Start) == ["r0", "r1"]
