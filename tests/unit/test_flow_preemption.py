"""Preemption in flow control's step (flow/state.py, `flow.preempt_priority`): an urgent
request that finds a role full asks one less urgent running stream to step aside; the stream
waits, ahead of its own priority, and goes on when a slot frees."""

from __future__ import annotations

import math
import random

from narwhal.config import KeyPolicy
from narwhal.flow.messages import (
    Begun,
    Done,
    Fence,
    Kept,
    Preempt,
    Refuse,
    Requeue,
    Start,
    Tick,
    Withdraw,
    WorkerLost,
)
from narwhal.flow.preemption import ASK_AGAIN_S
from narwhal.flow.state import FlowState
from tests.support.agenda import Agenda
from tests.unit.test_flow_state import LABEL, Fleet, ask, ids, policies


def running(state: FlowState, fleet: Fleet, i: int, priority: int, at: float = 0.0) -> None:
    """r<i> granted and placed on both roles (its prefill done: only decode is held)."""
    out = state.step(ask(i, priority, preemptible=True), at, fleet)
    assert ids(out, Start) == [f"r{i}"]
    state.step(Begun(f"r{i}", "prefill", "p0"), at, fleet)
    state.step(Begun(f"r{i}", "decode", f"d{i}"), at, fleet)


def preempts(out: list[Start | Refuse | Preempt]) -> list[str]:
    return [e.id for e in out if isinstance(e, Preempt)]


def full_decode(state: FlowState, *priorities: int) -> Fleet:
    """Every decode slot held by a running stream of each priority (r0, r1, ...)."""
    fleet = Fleet(prefill=8, decode=len(priorities))
    for i, priority in enumerate(priorities):
        running(state, fleet, i, priority, at=float(i))
        fleet.free["decode"] -= 1
    return fleet


def test_off_by_default_an_urgent_request_waits_for_a_slot() -> None:
    state = policies()
    fleet = full_decode(state, 2)
    out = state.step(ask(9, 0), 1.0, fleet)
    assert out == [] and state.waiting() == 1


def test_an_urgent_request_preempts_the_least_urgent_latest_stream_then_goes_first() -> None:
    state = policies()
    state.preemptions.priority = 0
    fleet = full_decode(state, 1, 2, 2)  # r0 (1, oldest), r1 (2), r2 (2, latest)
    out = state.step(ask(9, 0), 5.0, fleet)
    assert preempts(out) == ["r2"]
    assert [e.priority for e in out if isinstance(e, Preempt)] == [2]
    # Asked once: until r2 is off its engine, no other stream is asked.
    assert state.step(Tick(), 5.01, fleet) == []
    # r2's leg left: its slot is free, and the urgent request takes it, not r2.
    fleet.free["decode"] = 1
    out = state.step(Requeue("r2"), 5.02, fleet)
    assert ids(out, Start) == ["r9"]
    assert state.waiting() == 1  # r2 waits to go on
    state.step(Begun("r9", "prefill", "p0"), 5.03, fleet)
    fleet.free["decode"] = 0
    state.step(Begun("r9", "decode", "d2"), 5.03, fleet)
    # A newcomer of r2's priority waits behind r2, whatever its arrival.
    assert state.step(ask(10, 2), 5.04, fleet) == []
    fleet.free["decode"] = 1
    out = state.step(Done("r9", output_tokens=3), 5.1, fleet)
    assert ids(out, Start) == ["r2"]
    fleet.free["decode"] = 0
    state.step(Begun("r2", "decode", "d2"), 5.1, fleet)
    fleet.free["decode"] = 1
    assert ids(state.step(Done("r0", output_tokens=3), 5.2, fleet), Start) == ["r10"]


def test_a_stepped_aside_stream_goes_on_right_behind_the_urgency_it_lent_its_slot_to() -> None:
    """Ranked by the priority it stepped aside for: behind waiting priority-0 requests, ahead
    of a priority-1 one that waited longer; and the last to be asked again."""
    state = policies()
    state.queue.resize(16)
    state.preemptions.priority = 0
    fleet = full_decode(state, 2, 2, 2)  # r0, r1, r2

    def placed(request_id: str, at: float) -> None:
        fleet.free["decode"] -= 1
        state.step(Begun(request_id, "decode", "d"), at, fleet)

    assert state.step(ask(5, 1), 1.0, fleet) == []  # priority 1 waits
    assert preempts(state.step(ask(9, 0), 2.0, fleet)) == ["r2"]  # the latest
    fleet.free["decode"] += 1
    assert ids(state.step(Requeue("r2"), 2.01, fleet), Start) == ["r9"]
    placed("r9", 2.01)
    assert preempts(state.step(ask(10, 0), 2.02, fleet)) == ["r1"]  # r2 is not running
    fleet.free["decode"] += 1
    # r2 waits to go on, at priority 0's rank: the waiting priority-0 request goes first.
    assert ids(state.step(Requeue("r1"), 2.03, fleet), Start) == ["r10"]
    placed("r10", 2.03)
    fleet.free["decode"] += 1
    assert ids(state.step(Done("r9", output_tokens=1), 2.1, fleet), Start) == ["r2"]
    placed("r2", 2.1)
    fleet.free["decode"] += 1
    assert ids(state.step(Done("r10", output_tokens=1), 2.2, fleet), Start) == ["r1"]  # not r5
    placed("r1", 2.2)
    # r1 and r2 stepped aside once each: r0 (never) is asked first, the earliest started.
    assert preempts(state.step(ask(11, 0), 2.3, fleet)) == ["r0"]


def test_only_less_urgent_preemptible_streams_holding_the_lacking_role_are_asked() -> None:
    state = policies()
    state.preemptions.priority = 1
    # Equal priority is never preempted; a request less urgent than preempt_priority asks nothing.
    fleet = full_decode(state, 1)
    assert preempts(state.step(ask(8, 1), 1.0, fleet)) == []
    assert preempts(state.step(ask(9, 2), 1.1, fleet)) == []
    # A stream that cannot migrate is not asked.
    state = policies()
    state.preemptions.priority = 0
    fleet = Fleet(prefill=8, decode=1)
    assert ids(state.step(ask(0, 2), 0.0, fleet), Start) == ["r0"]
    state.step(Begun("r0", "decode", "d0"), 0.0, fleet)
    fleet.free["decode"] = 0
    assert preempts(state.step(ask(9, 0), 1.0, fleet)) == []
    # A full prefill role: a prefill frees on its own, no stream is asked.
    state = policies()
    state.preemptions.priority = 0
    fleet = full_decode(state, 2)
    fleet.free = {"prefill": 0, "decode": 0}
    assert preempts(state.step(ask(9, 0), 1.0, fleet)) == []
    # A stream still in its prefill holds no decode slot yet: not asked.
    state = policies()
    state.preemptions.priority = 0
    fleet = Fleet(prefill=8, decode=1)
    assert ids(state.step(ask(0, 2, preemptible=True), 0.0, fleet), Start) == ["r0"]
    state.step(Begun("r0", "prefill", "p0"), 0.0, fleet)
    fleet.free["decode"] = 0
    assert preempts(state.step(ask(9, 0), 1.0, fleet)) == []


def test_among_the_least_urgent_the_most_served_clients_stream_steps_aside() -> None:
    """The client the queue would shed first pays for preemption, even when a light client's
    stream started later; within one client, the latest started."""
    state = policies()
    state.preemptions.priority = 0
    fleet = Fleet(prefill=8, decode=3)
    for i, client in enumerate(("heavy", "heavy", "light")):  # r2 (light) is the latest
        out = state.step(ask(i, 2, client=client, preemptible=True), float(i), fleet)
        assert ids(out, Start) == [f"r{i}"]
        state.step(Begun(f"r{i}", "decode", f"d{i}"), float(i), fleet)
        fleet.free["decode"] -= 1
    state.queue.counters.charge("heavy", 500)  # heavy has been served more
    assert preempts(state.step(ask(9, 0), 5.0, fleet)) == ["r1"]


def test_a_stream_that_ends_while_waiting_to_go_on_is_charged_what_it_used() -> None:
    """Its deadline came while it waited: its `Done` takes it out of the streams waiting to
    go on and settles its key's tokens at what it used (prompt and delivered), not at none."""
    state = policies(**{LABEL: KeyPolicy(tokens_per_minute=100)})
    state.preemptions.priority = 0
    fleet = Fleet(prefill=8, decode=1)
    keyed = {"key": LABEL, "client": LABEL, "rate_tokens": 60, "preemptible": True}
    assert ids(state.step(ask(0, 2, **keyed), 0.0, fleet), Start) == ["r0"]
    state.step(Begun("r0", "decode", "d0"), 0.0, fleet)
    fleet.free["decode"] = 0
    assert preempts(state.step(ask(9, 0), 1.0, fleet)) == ["r0"]
    fleet.free["decode"] = 1
    assert ids(state.step(Requeue("r0"), 1.01, fleet), Start) == ["r9"]  # r0 waits to go on
    fleet.free["decode"] = 0
    state.step(Begun("r9", "decode", "d0"), 1.01, fleet)
    assert state.waiting() == 1
    state.step(Done("r0", output_tokens=15, prompt_tokens=5), 2.0, fleet)  # used 20 of 60
    assert state.waiting() == 0 and "r0" not in state
    # 80 of the key's 100 left (less a trickle of refill): a 60-token ask fits, a second not.
    assert ids(state.step(ask(1, 2, **keyed), 2.0, fleet), Refuse) == []
    assert ids(state.step(ask(2, 2, **keyed), 2.0, fleet), Refuse) == ["r2"]


def test_a_stream_whose_leaving_frees_nothing_is_not_asked() -> None:
    """Its engine is full by its own queue or KV cache, not by Narwhal's count."""
    state = policies()
    state.preemptions.priority = 0
    fleet = full_decode(state, 2, 2)
    state.preemptions.frees = lambda group, role, engine_id: engine_id == "d0"
    assert preempts(state.step(ask(9, 0), 5.0, fleet)) == ["r0"]


def test_a_stream_that_cannot_step_aside_is_kept_and_another_is_asked() -> None:
    state = policies()
    state.preemptions.priority = 0
    fleet = full_decode(state, 2, 2)
    assert preempts(state.step(ask(9, 0), 5.0, fleet)) == ["r1"]
    assert preempts(state.step(Kept("r1"), 5.01, fleet)) == ["r0"]
    assert preempts(state.step(Kept("r0"), 5.02, fleet)) == []  # none left to ask
    assert preempts(state.step(Tick(), 5.03, fleet)) == []


def test_a_stream_that_cannot_step_aside_yet_is_asked_again_a_little_later() -> None:
    """Kept for now (its decode placed, its first byte not read yet): the next one is asked
    meanwhile, and it is asked again once `ASK_AGAIN_S` has passed, not before."""
    state = policies()
    state.preemptions.priority = 0
    fleet = full_decode(state, 2, 2)
    assert preempts(state.step(ask(9, 0), 5.0, fleet)) == ["r1"]
    assert preempts(state.step(Kept("r1", for_now=True), 5.01, fleet)) == ["r0"]
    assert preempts(state.step(Kept("r0"), 5.02, fleet)) == []  # r0: never
    assert preempts(state.step(Tick(), 5.01 + ASK_AGAIN_S - 0.001, fleet)) == []
    assert preempts(state.step(Tick(), 5.01 + ASK_AGAIN_S, fleet)) == ["r1"]


def test_fencing_withdrawal_and_a_lost_worker_take_waiting_streams_out() -> None:
    state = policies()
    state.preemptions.priority = 0
    fleet = full_decode(state, 2, 2)
    state.step(ask(9, 0), 5.0, fleet)
    # its slot not seen free: nobody else asked
    state.preemptions.frees = lambda group, role, engine_id: False
    assert preempts(state.step(Requeue("r1"), 5.01, fleet)) == []
    assert state.waiting() == 2
    out = state.step(Fence("lease lost"), 5.02, fleet)
    assert sorted(ids(out, Refuse)) == ["r1", "r9"]
    assert all(e.status == 503 for e in out if isinstance(e, Refuse))
    assert state.waiting() == 0

    state = policies()
    state.preemptions.priority = 0
    fleet = full_decode(state, 2, 2)
    # d0 is full by its KV cache
    state.preemptions.frees = lambda group, role, engine_id: engine_id == "d1"
    state.step(ask(9, 0), 5.0, fleet)
    # r1's slot is not seen free (a scrape says its engine is full after all): r0 is on an
    # engine its leaving would not free, so nobody else is asked.
    state.preemptions.frees = lambda group, role, engine_id: False
    assert preempts(state.step(Requeue("r1"), 5.01, fleet)) == []
    state.step(Withdraw("r1"), 5.02, fleet)  # its client left while it waited
    assert state.waiting() == 1 and "r1" not in state
    state.step(WorkerLost(0), 5.04, fleet)
    assert len(state) == 0 and state.waiting() == 0


def test_a_requeue_not_asked_for_is_ignored() -> None:
    state = policies()
    state.preemptions.priority = 0
    fleet = full_decode(state, 2)
    assert state.step(Requeue("r0"), 1.0, fleet) == []
    assert state.waiting() == 0 and "r0" in state


def run_bench_shape(preempt: bool, seed: int = 5) -> tuple[list[float], float, list[float]]:
    """The `flow` bench suite's shape in virtual time through the whole step: 8 decode slots,
    answers of 8-24 tokens at 20 ms, the same arrivals at 2x capacity (priorities 0, 1, 2 at
    0.3, 0.4 and 1.3 of it). A stepped-aside stream goes on after a 10 ms re-prefill. The
    waits of priority 0 from arrival to start, the decode seconds of output served per
    second (the re-prefills not counted), and the pauses of the streams that stepped aside."""
    slots, itl_s, run_s, warmup_s = 8, 0.02, 300.0, 30.0
    redo_s = 0.01
    capacity_per_s = slots / (16 * itl_s)
    rates = {0: 0.3, 1: 0.4, 2: 1.3}
    rng = random.Random(seed)
    state = policies()
    state.queue.resize(1024)
    state.preemptions.priority = 0 if preempt else None
    fleet = Fleet(prefill=math.inf, decode=slots)
    agenda: Agenda[str] = Agenda()
    push = agenda.push
    for priority, share in rates.items():
        push(rng.expovariate(share * capacity_per_s), "arrive", str(priority))
    left: dict[str, float] = {}  # request: service still to give
    until: dict[str, tuple[float, float]] = {}  # running: (started, ends)
    arrived: dict[str, float] = {}
    waits: list[float] = []
    redo: dict[str, float] = {}  # the re-prefill a resumed run does first: not output
    paused: dict[str, float] = {}
    pauses: list[float] = []
    served_s = 0.0
    now = 0.0

    def useful(begun: float, rid: str) -> None:
        nonlocal served_s
        if now >= warmup_s:
            served_s += now - begun - redo.pop(rid, 0.0)

    def apply(out: list[Start | Refuse | Preempt]) -> None:
        for effect in out:
            if isinstance(effect, Start):
                fleet.free["decode"] -= 1
                state.step(Begun(effect.id, "decode", "d0"), now, fleet)
                begun, ends = now, now + left[effect.id]
                until[effect.id] = (begun, ends)
                push(ends, "done", effect.id)
                if effect.id in arrived and effect.priority == 0:
                    waits.append(now - arrived.pop(effect.id))
                arrived.pop(effect.id, None)
                if effect.id in paused:
                    pauses.append(now - paused.pop(effect.id))
            elif isinstance(effect, Preempt):
                begun, _ = until.pop(effect.id)
                useful(begun, effect.id)
                left[effect.id] -= now - begun
                left[effect.id] += redo_s
                redo[effect.id] = redo_s
                fleet.free["decode"] += 1
                paused[effect.id] = now
                apply(state.step(Requeue(effect.id), now, fleet))

    while (event := agenda.pop()) is not None:
        now, kind, what = event
        if now > run_s:
            break
        if kind == "arrive":
            priority = int(what)
            push(now + rng.expovariate(rates[priority] * capacity_per_s), "arrive", what)
            rid = f"r{agenda.count}"
            left[rid] = rng.randint(8, 24) * itl_s
            if now >= warmup_s:
                arrived[rid] = now
            out = state.step(ask(agenda.count, priority, wait_s=5.0, preemptible=True), now, fleet)
        elif what in until and until[what][1] == now:  # not a done of a preempted run
            begun, _ = until.pop(what)
            useful(begun, what)
            fleet.free["decode"] += 1
            out = state.step(Done(what, output_tokens=1), now, fleet)
        else:
            continue
        apply(out)
    return waits, served_s / (run_s - warmup_s), pauses


def test_in_the_bench_shape_preemption_starts_priority_0_at_once_and_keeps_the_throughput() -> None:
    waits, busy, pauses = run_bench_shape(preempt=True)
    base_waits, base_busy, _ = run_bench_shape(preempt=False)
    at_once = sum(w == 0 for w in waits) / len(waits)
    base_at_once = sum(w == 0 for w in base_waits) / len(base_waits)
    assert at_once >= 0.99, (at_once, base_at_once)
    assert base_at_once < 0.9  # without it, priority 0 waits for a slot to free (can fail)
    assert busy >= 0.95 * base_busy, (busy, base_busy)
    # A stream that stepped aside goes on soon: it ranks right behind the urgency it lent
    # its slot to (ranked by its own priority, the pauses here reach 0.89 s, p99 0.78 s).
    assert max(pauses) < 0.5, sorted(pauses)[-5:]


def test_a_slot_a_stream_freed_goes_to_its_own_model_first_on_an_engine_two_models_share() -> None:
    """One decode slot on an engine serving two models (a base model and a LoRA adapter): the
    other model's request waited first, but the slot the preempted stream freed is the urgent
    request's, and the other model's request is not granted on top of it."""
    state = policies()
    state.preemptions.priority = 0
    state.shares = lambda group, other, role: True
    fleet = full_decode(state, 2)  # r0 of model m holds the slot
    assert state.step(ask(5, 2, group="lora"), 1.0, fleet) == []  # waits first
    assert preempts(state.step(ask(9, 0), 2.0, fleet)) == ["r0"]
    fleet.free["decode"] = 1
    out = state.step(Requeue("r0"), 2.01, fleet)
    assert ids(out, Start) == ["r9"]
    assert state.step(Tick(), 2.02, fleet) == []  # r9's grant is not placed yet: no room
    state.step(Begun("r9", "prefill", "p0"), 2.03, fleet)
    fleet.free["decode"] = 0
    state.step(Begun("r9", "decode", "d0"), 2.03, fleet)
    fleet.free["decode"] = 1
    out = state.step(Done("r9", output_tokens=1), 2.1, fleet)
    assert ids(out, Start) == ["r0"]  # it goes on, ahead of the other model's request
