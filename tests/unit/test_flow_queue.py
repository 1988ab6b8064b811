"""The wait queue (flow/queue.py): table-driven cases for each decision, and a property test
that every sequence of operations gives the answers of a plain reference (a list scanned in
full each time), never exceeds its limit, and starts entries in priority order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.flow.queue import Entry, WaitQueue
from narwhal.flow.reasons import ShedReason


def entry(
    id_: str,
    client: str = "a",
    priority: int = 0,
    tokens: int = 10,
    at: float = 0.0,
    deadline: float = 100.0,
    group: str = "",
) -> Entry:
    return Entry(id_, client, priority, tokens, at, deadline, group)


def starts(q: WaitQueue, group: str = "") -> list[str]:
    out = []
    while (e := q.next_start(group)) is not None:
        out.append(e.id)
    return out


# ---------------------------------------------------------------- order
def test_priority_first_lower_number_first() -> None:
    q = WaitQueue(10)
    for id_, prio in [("low", 5), ("high", -1), ("mid", 0), ("mid2", 0)]:
        assert q.admit(entry(id_, client=id_, priority=prio), 0.0).accepted
    assert starts(q) == ["high", "mid", "mid2", "low"]


def test_within_a_priority_the_least_served_client_then_fifo() -> None:
    q = WaitQueue(10)
    q.charge("heavy", 1000)  # served before it queued: an idle client's counter stands
    for id_, client in [("h1", "heavy"), ("h2", "heavy"), ("l1", "light"), ("l2", "light")]:
        q.admit(entry(id_, client=client, tokens=100), 0.0)
    # heavy joined an empty backlog with 1000; light was lifted to heavy's 1000 (no credit
    # for being idle); ties go to the earliest head, then each start charges 100.
    assert starts(q) == ["h1", "l1", "h2", "l2"]


def test_an_idle_client_banks_no_credit() -> None:
    q = WaitQueue(10)
    q.admit(entry("a1", client="a", tokens=500), 0.0)
    assert q.next_start() is not None  # a served 500 while b was away
    q.admit(entry("a2", client="a", tokens=500), 0.0)
    q.admit(entry("b1", client="b", tokens=500), 0.0)
    # b joins at a's counter (the least backlogged), not at 0: it gets no 500-token head start
    assert q.counters.value("b") == q.counters.value("a") == 500
    assert starts(q) == ["a2", "b1"]


def test_weights_scale_the_counters() -> None:
    weights = {"gold": 3.0, "std": 1.0}
    q = WaitQueue(100, weight=weights.__getitem__)
    for i in range(8):
        q.admit(entry(f"g{i}", client="gold", tokens=30, at=i), 0.0)
        q.admit(entry(f"s{i}", client="std", tokens=30, at=i), 0.0)
    first8 = starts(q)[:8]
    assert sum(x.startswith("g") for x in first8) == 6  # 3:1 while both wait


def test_groups_do_not_hold_each_other_up() -> None:
    q = WaitQueue(10)
    q.admit(entry("m1", group="model-a"), 0.0)
    q.admit(entry("n1", group="model-b", priority=9), 0.0)
    assert q.has_waiting("model-b") and not q.has_waiting("model-c")
    assert starts(q, "model-b") == ["n1"]
    assert starts(q, "model-a") == ["m1"]
    assert q.next_start("model-a") is None


# ---------------------------------------------------------------- shedding
@dataclass
class ShedCase:
    name: str
    waiting: list[Entry]
    newcomer: Entry
    # charged once the others wait (output tokens of their running requests)
    charges: dict[str, int] = field(default_factory=dict)
    accepted: bool = True
    shed: str | None = None


SHED_CASES = [
    ShedCase(
        "the lowest priority goes first",
        [entry("p0", priority=0), entry("p2", client="b", priority=2)],
        entry("new", client="c", priority=1),
        shed="p2",
    ),
    ShedCase(
        "the newcomer when it is the lowest priority",
        [entry("p0", priority=0), entry("p1", client="b", priority=1)],
        entry("new", client="c", priority=2),
        accepted=False,
        shed="new",
    ),
    ShedCase(
        "within a priority, the most-served client's newest",
        [entry("a1", "a"), entry("a2", "a"), entry("b1", "b")],
        entry("new", client="c"),
        charges={"a": 50},
        shed="a2",
    ),
    ShedCase(
        "the newcomer of the most-served client",
        [entry("a1", "a"), entry("b1", "b")],
        entry("new", client="b"),
        charges={"b": 50},
        accepted=False,
        shed="new",
    ),
    ShedCase(
        "a tie goes against the newcomer (it waited least)",
        [entry("a1", "a"), entry("b1", "b")],
        entry("new", client="c"),
        accepted=False,
        shed="new",
    ),
    ShedCase(
        "a higher-priority newcomer displaces even a less-served client",
        [entry("a1", "a", priority=3), entry("b1", "b", priority=1)],
        entry("new", client="c", priority=0),
        charges={"c": 10_000},
        shed="a1",
    ),
]


@pytest.mark.parametrize("case", SHED_CASES, ids=lambda c: c.name)
def test_shedding(case: ShedCase) -> None:
    q = WaitQueue(len(case.waiting))
    for e in case.waiting:
        assert q.admit(e, 0.0).accepted
    for client, tokens in case.charges.items():
        q.charge(client, tokens)
    got = q.admit(case.newcomer, 0.0)
    assert got.accepted is case.accepted
    assert got.shed is not None and got.shed.id == case.shed
    assert got.reason is ShedReason.QUEUE_FULL
    assert len(q) == len(case.waiting)
    assert (case.newcomer.id in q) is case.accepted and case.shed not in q


def test_a_zero_limit_refuses_everything() -> None:
    q = WaitQueue(0)
    got = q.admit(entry("x"), 0.0)
    assert (got.accepted, got.reason) == (False, ShedReason.QUEUE_FULL)


def test_resize_sheds_the_worst_first() -> None:
    q = WaitQueue(4)
    for id_, prio in [("a", 0), ("b", 3), ("c", 1), ("d", 3)]:
        q.admit(entry(id_, client=id_, priority=prio), 0.0)
    assert [e.id for e in q.resize(1)] == ["d", "b", "c"]
    assert [e.id for e in q] == ["a"]


# ---------------------------------------------------------------- deadlines, leaving
def test_expire_answers_what_can_no_longer_start() -> None:
    q = WaitQueue(10)
    q.admit(entry("late", deadline=5.0), 0.0)
    q.admit(entry("soon", deadline=2.0), 0.0)
    q.admit(entry("later", deadline=9.0), 0.0)
    assert q.next_deadline() == 2.0
    assert q.expire(1.9) == []
    assert [e.id for e in q.expire(5.0)] == ["soon", "late"]
    assert q.next_deadline() == 9.0 and len(q) == 1


def test_a_newcomer_past_its_deadline_is_refused_at_once() -> None:
    q = WaitQueue(10)
    got = q.admit(entry("x", deadline=3.0), 3.0)
    assert (got.accepted, got.reason) == (False, ShedReason.DEADLINE)
    assert got.shed == entry("x", deadline=3.0)
    assert len(q) == 0


def test_remove_and_drain() -> None:
    q = WaitQueue(10)
    for i in range(4):
        q.admit(entry(f"e{i}", client=f"c{i % 2}", priority=i % 3), 0.0)
    removed = q.remove("e1")
    assert removed is not None and removed.id == "e1"
    assert q.remove("e1") is None
    assert [e.id for e in q.drain()] == ["e0", "e2", "e3"]
    assert len(q) == 0 and q.depth() == {} and q.next_start() is None and q.next_deadline() is None
    assert not q.counters.backlogged("c0")


def test_depth_by_priority() -> None:
    q = WaitQueue(10)
    for i, prio in enumerate([0, 0, 2]):
        q.admit(entry(f"e{i}", client=str(i), priority=prio), 0.0)
    assert q.depth() == {0: 2, 2: 1}
    q.next_start()
    assert q.depth() == {0: 1, 2: 1}


def test_an_id_waits_once() -> None:
    q = WaitQueue(10)
    q.admit(entry("x"), 0.0)
    with pytest.raises(ValueError, match="already waiting"):
        q.admit(entry("x"), 0.0)


# ---------------------------------------------------------------- against a reference
class Reference:
    """The queue's rules written as plainly as possible: full scans, no heaps."""

    def __init__(self, limit: int, weight: dict[str, float]) -> None:
        self.limit = limit
        self.weight = weight
        self.waiting: list[tuple[Entry, int]] = []
        self.counter: dict[str, float] = {}
        self.last_left: str | None = None
        self.seq = 0

    def c(self, client: str) -> float:
        return self.counter.get(client, 0.0)

    def backlogged(self) -> set[str]:
        return {e.client for e, _ in self.waiting}

    def lifted(self, client: str) -> float:
        back = self.backlogged()
        if client in back:
            return self.c(client)
        if back:
            return max(self.c(client), min(self.c(b) for b in back))
        if self.last_left is not None:
            return max(self.c(client), self.c(self.last_left))
        return self.c(client)

    def take(self, e: Entry, charge: bool = False) -> Entry:
        self.waiting = [(x, s) for x, s in self.waiting if x.id != e.id]
        if e.client not in self.backlogged():
            self.last_left = e.client
        if charge:
            self.counter[e.client] = self.c(e.client) + e.tokens / self.weight[e.client]
        return e

    def queued(self, client: str) -> float:
        return sum(e.tokens / self.weight[client] for e, _ in self.waiting if e.client == client)

    def served(self, client: str) -> float:
        """What shedding ranks by: the counter plus what the client has waiting."""
        return self.c(client) + self.queued(client)

    def worst(self) -> tuple[Entry, int]:
        return max(self.waiting, key=lambda p: (p[0].priority, self.served(p[0].client), p[1]))

    def admit(self, e: Entry, now: float) -> tuple[bool, str | None]:
        if e.deadline <= now:
            return False, e.id
        shed = None
        if len(self.waiting) >= self.limit:
            if not self.waiting:
                return False, e.id
            w, _ = self.worst()
            mine = self.lifted(e.client) + self.queued(e.client) + e.tokens / self.weight[e.client]
            if (e.priority, mine) >= (w.priority, self.served(w.client)):
                return False, e.id
            shed = self.take(w).id
        self.counter[e.client] = self.lifted(e.client)
        self.seq += 1
        self.waiting.append((e, self.seq))
        return True, shed

    def next_start(self, group: str) -> str | None:
        mine = [p for p in self.waiting if p[0].group == group]
        if not mine:
            return None
        e, _ = min(mine, key=lambda p: (p[0].priority, self.c(p[0].client), p[1]))
        return self.take(e, charge=True).id

    def charge(self, client: str, tokens: int) -> None:
        self.counter[client] = self.c(client) + tokens / self.weight[client]

    def expire(self, now: float) -> list[str]:
        due = [p for p in self.waiting if p[0].deadline <= now]
        due.sort(key=lambda p: (p[0].deadline, p[1]))
        return [self.take(e).id for e, _ in due]


CLIENTS = ["a", "b", "c", "d"]
WEIGHTS = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 0.5}

ops = st.one_of(
    st.tuples(
        st.just("admit"),
        st.sampled_from(CLIENTS[:3]) | st.sampled_from(CLIENTS),  # some lanes grow long
        st.integers(0, 2) | st.just(1),  # priority
        st.integers(1, 200),  # tokens
        st.floats(0.5, 20.0),  # time to its deadline
        st.sampled_from(["", "", "g"]),
    ),
    st.tuples(st.just("start"), st.sampled_from(["", "g"])),
    st.tuples(st.just("charge"), st.sampled_from(CLIENTS), st.integers(1, 300)),
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
    st.tuples(st.just("remove"), st.integers(0, 50)),
)


@settings(max_examples=400, deadline=None)
@given(limit=st.integers(0, 8), steps=st.lists(ops, max_size=100))
def test_the_queue_decides_as_the_reference(limit: int, steps: list[tuple[object, ...]]) -> None:
    q, ref = WaitQueue(limit, weight=WEIGHTS.__getitem__), Reference(limit, WEIGHTS)
    now, n = 0.0, 0
    started: dict[str, list[int]] = {"": [], "g": []}
    for step in steps:
        match step:
            case ("admit", str(client), int(prio), int(tokens), float(wait), str(group)):
                n += 1
                e = Entry(f"e{n}", client, prio, tokens, now, now + wait, group)
                got = q.admit(e, now)
                shed = None if got.shed is None else got.shed.id
                assert (got.accepted, shed) == ref.admit(e, now)
            case ("start", str(group)):
                got_e = q.next_start(group)
                want = ref.next_start(group)
                assert (None if got_e is None else got_e.id) == want
                if got_e is not None:
                    started[group].append(got_e.priority)
            case ("charge", str(client), int(tokens)):
                q.charge(client, tokens)
                ref.charge(client, tokens)
            case ("advance", float(dt)):
                now += dt
                assert [e.id for e in q.expire(now)] == ref.expire(now)
            case ("remove", int(i)):
                ids = [e.id for e, _ in ref.waiting]
                if ids:
                    victim = ids[i % len(ids)]
                    got_r = q.remove(victim)
                    assert got_r is not None and got_r.id == victim
                    ref.take(got_r)
        assert len(q) <= max(limit, 0)
        assert [e.id for e in q] == [e.id for e, _ in ref.waiting]
        for client in CLIENTS:
            assert q.counters.value(client) == pytest.approx(ref.c(client))
        depth: dict[int, int] = {}
        for e, _ in ref.waiting:
            depth[e.priority] = depth.get(e.priority, 0) + 1
        assert q.depth() == depth


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(CLIENTS), st.integers(-3, 3)), min_size=1, max_size=40))
def test_starts_drain_in_priority_order(items: list[tuple[str, int]]) -> None:
    q = WaitQueue(len(items))
    for i, (client, prio) in enumerate(items):
        q.admit(entry(f"e{i}", client=client, priority=prio), 0.0)
    prios = []
    while (e := q.next_start()) is not None:
        prios.append(e.priority)
    assert prios == sorted(prios) and len(prios) == len(items)
