"""Virtual token counters (flow/vtc.py) and the fairness they give the wait queue: two
equal-weight clients backlogged together are served within a bounded number of tokens of
each other, whatever each sends."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.flow.queue import Entry, WaitQueue
from narwhal.flow.vtc import VirtualCounters

MAX_TOKENS = 500  # the largest request of these tests: the fairness bound's unit


def test_the_lift_rule() -> None:
    v = VirtualCounters()
    assert v.floor() is None and v.join("a") == 0.0
    v.charge("a", 300)
    v.charge("z", 50)  # served while not waiting (no queue at the time)
    assert v.join("z") == 300  # lifted to the least backlogged counter: no credit kept
    v.charge("z", 100)
    assert v.floor() == 300
    v.leave("a")
    v.leave("z")
    assert not v.backlogged("a") and v.floor() == 400  # nobody waits: the last to leave
    assert v.lifted("new") == 400
    v.charge("rich", 10_000)
    assert v.join("rich") == 10_000  # a lift never lowers


def test_weights_divide_the_charge_and_follow_a_reload() -> None:
    weights = {"a": 2.0}
    v = VirtualCounters(lambda c: weights.get(c, 1.0))
    assert v.charge("a", 100) == 50 and v.charge("b", 100) == 100
    v.weight = lambda c: 4.0
    assert v.charge("a", 100) == 75


def test_prune_forgets_only_who_would_be_lifted_anyway() -> None:
    v = VirtualCounters()
    for client, tokens in [("a", 10), ("b", 500), ("c", 20), ("w", 100)]:
        v.charge(client, tokens)
    v.join("w")
    assert v.prune() == 2  # a and c: at or below w's 100
    assert v.value("b") == 500 and v.value("w") == 100 and len(v) == 2


def served_gap_ok(sizes: list[tuple[int, int]], arrivals: list[int]) -> None:
    """Two clients, `a` and `b`, in one queue; each step either brings one client's next
    request (`arrivals`) or starts one. Over every stretch in which both are backlogged,
    the tokens each was served differ by at most two requests' worth (VTC's bound)."""
    q = WaitQueue(10_000)
    served = {"a": 0, "b": 0}
    mark: dict[str, int] | None = None  # served when the current shared backlog began
    n = 0
    for i, client_bit in enumerate(arrivals):
        if client_bit < 2:
            client = "ab"[client_bit]
            tokens = sizes[i % len(sizes)][client_bit]
            n += 1
            q.admit(Entry(f"r{n}", client, 0, tokens, 0.0, 1e9), 0.0)
        else:
            e = q.next_start()
            if e is not None:
                served[e.client] += e.tokens
        both = q.counters.backlogged("a") and q.counters.backlogged("b")
        if both and mark is None:
            mark = dict(served)
        elif not both:
            mark = None
        if mark is not None:
            gap = (served["a"] - mark["a"]) - (served["b"] - mark["b"])
            assert abs(gap) <= 2 * MAX_TOKENS


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, MAX_TOKENS), st.integers(1, MAX_TOKENS)), min_size=1),
    arrivals=st.lists(st.integers(0, 2), max_size=300),
)
def test_backlogged_clients_stay_within_the_bound(
    sizes: list[tuple[int, int]], arrivals: list[int]
) -> None:
    served_gap_ok(sizes, arrivals)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, MAX_TOKENS), st.integers(1, MAX_TOKENS)), min_size=1)
)
def test_always_backlogged_clients_never_differ_by_more_than_one_request(
    sizes: list[tuple[int, int]],
) -> None:
    """Both keep requests waiting at all times (two each: a start never empties a
    client's backlog, which would lift it on its next request), from a zero start: the tokens
    served never differ by more than the largest request."""
    q = WaitQueue(10)
    served = {"a": 0, "b": 0}
    sent = {"a": 0, "b": 0}

    def send(client: str) -> None:
        bit = "ab".index(client)
        tokens = sizes[sent[client] % len(sizes)][bit]
        sent[client] += 1
        q.admit(Entry(f"{client}{sent[client]}", client, 0, tokens, 0.0, 1e9), 0.0)

    for client in "abab":
        send(client)
    for _ in range(200):
        e = q.next_start()
        assert e is not None
        served[e.client] += e.tokens
        assert abs(served["a"] - served["b"]) <= MAX_TOKENS
        send(e.client)


def test_the_bound_is_not_met_without_the_lift() -> None:
    """The check above can fail: a client that banked credit while idle (no lift) gets
    served far beyond two requests' worth ahead of the other."""
    q = WaitQueue(10_000)
    q.admit(Entry("a0", "a", 0, MAX_TOKENS, 0.0, 1e9), 0.0)
    for i in range(20):  # a alone: its counter grows to 20 requests' worth
        assert q.next_start() is not None
        q.admit(Entry(f"a{i + 1}", "a", 0, MAX_TOKENS, 0.0, 1e9), 0.0)
    q.counters._values["b"] = 0.0  # as if b were never lifted
    q.counters._backlog.set("b", (0.0,))
    q.admit(Entry("b0", "b", 0, MAX_TOKENS, 0.0, 1e9), 0.0)
    for i in range(10):
        q.admit(Entry(f"b{i + 1}", "b", 0, MAX_TOKENS, 0.0, 1e9), 0.0)
    firsts = [q.next_start() for _ in range(6)]
    assert all(e is not None and e.client == "b" for e in firsts)  # 6 x 500 > 2 x 500
