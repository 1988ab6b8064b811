"""The wait queue in virtual time: a fleet of 8 slots, four equal-weight clients each asking
for more than a quarter of it, one of them sending 10x the others. Fair queueing gives each
about a quarter of the served tokens (Jain's index >= 0.95); first come first served, over
the same arrivals, gives the heavy client most of them (the check can fail)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from narwhal.flow.queue import Entry, WaitQueue
from tests.support.agenda import Agenda

SLOTS = 8
QUEUE_LIMIT = 64
MAX_WAIT_S = 30.0
RUN_S, WARMUP_S = 900.0, 100.0


@dataclass(frozen=True, slots=True)
class Request:
    client: str
    prompt: int
    output: int

    @property
    def service_s(self) -> float:
        return 0.001 * self.prompt + 0.02 * self.output


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def run(fair: bool, seed: int = 7) -> dict[str, int]:
    """Served tokens per client after the warm-up. `fair=False`: every request queues under
    one client name, so the queue is FIFO within a priority."""
    rng = random.Random(seed)
    mean_s = 0.001 * 250 + 0.02 * 110
    capacity_per_s = SLOTS / mean_s
    rates = {"light1": 0.4, "light2": 0.4, "light3": 0.4, "heavy": 4.0}  # x capacity
    agenda: Agenda[str] = Agenda()
    push = agenda.push
    for client, share in rates.items():
        push(rng.expovariate(share * capacity_per_s), "arrive", client)
    q = WaitQueue(QUEUE_LIMIT)
    requests: dict[str, Request] = {}
    busy = 0
    served = dict.fromkeys(rates, 0)
    now = 0.0

    def start_what_fits() -> None:
        nonlocal busy
        while busy < SLOTS and (e := q.next_start()) is not None:
            busy += 1
            push(now + requests[e.id].service_s, "done", e.id)

    while (event := agenda.pop()) is not None:
        now, kind, what = event
        if now > RUN_S:
            break
        q.expire(now)
        if kind == "arrive":
            client = what
            push(now + rng.expovariate(rates[client] * capacity_per_s), "arrive", client)
            req = Request(client, rng.randint(100, 400), rng.randint(20, 200))
            rid = f"r{agenda.count}"
            requests[rid] = req
            queued_as = client if fair else "everyone"
            q.admit(Entry(rid, queued_as, 0, req.prompt, now, now + MAX_WAIT_S), now)
        else:
            busy -= 1
            req = requests[what]
            q.charge(req.client if fair else "everyone", req.output)
            if now >= WARMUP_S:
                served[req.client] += req.prompt + req.output
        start_what_fits()
    return served


def test_equal_weight_backlogged_clients_get_equal_shares() -> None:
    served = run(fair=True)
    index = jain([float(v) for v in served.values()])
    assert index >= 0.95, served
    assert served["heavy"] < 1.5 * min(served.values()), served  # its share, not 10x


def test_first_come_first_served_is_not_fair_here() -> None:
    served = run(fair=False)
    assert jain([float(v) for v in served.values()]) < 0.8, served
    assert served["heavy"] > 3 * max(v for k, v in served.items() if k != "heavy"), served


def run_priorities(seed: int = 3) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """The `flow` bench suite's shape in virtual time: 8 slots of 0.36 s, four keys sending
    alike at priorities 0 and 1 (0.075 and 0.1 of capacity each) and at priority 2 one key
    10x the others (1.0 against 0.1), 5 s of wait at most. Requests (asked, served) per
    (key, priority) after the warm-up."""
    service_s, run_s, warmup_s, max_wait_s = 0.36, 600.0, 60.0, 5.0
    capacity_per_s = SLOTS / service_s
    rates = {(k, p): r for k in range(4) for p, r in ((0, 0.075), (1, 0.1), (2, 0.1))}
    rates[0, 2] = 1.0
    rng = random.Random(seed)
    agenda: Agenda[object] = Agenda()
    push = agenda.push
    for cls, share in rates.items():
        push(rng.expovariate(share * capacity_per_s), "arrive", cls)
    q = WaitQueue(1024)
    classes: dict[str, tuple[int, int]] = {}
    asked: dict[tuple[int, int], int] = dict.fromkeys(rates, 0)
    served: dict[tuple[int, int], int] = dict.fromkeys(rates, 0)
    busy, now = 0, 0.0
    while (event := agenda.pop()) is not None:
        now, kind, what = event
        if now > run_s:
            break
        q.expire(now)
        if kind == "arrive":
            cls = what
            assert isinstance(cls, tuple)
            push(now + rng.expovariate(rates[cls] * capacity_per_s), "arrive", cls)
            rid = f"r{agenda.count}"
            classes[rid] = cls
            asked[cls] += now >= warmup_s
            q.admit(Entry(rid, f"key{cls[0]}", cls[1], 10, now, now + max_wait_s), now)
        else:
            busy -= 1
            cls = classes[str(what)]
            q.charge(f"key{cls[0]}", 16)  # output tokens, at the end
            served[cls] += now >= warmup_s
        while busy < SLOTS and (e := q.next_start()) is not None:
            busy += 1
            push(now + service_s, "done", e.id)
    return asked, served


def max_min_shares(asked: list[int], total: int) -> list[float]:
    """Each client's max-min fair share of `total`: what it asked, if under an equal split."""
    shares = [0.0] * len(asked)
    left, remaining = list(range(len(asked))), float(total)
    while left:
        equal = remaining / len(left)
        under = [i for i in left if asked[i] <= equal]
        if not under:
            for i in left:
                shares[i] = equal
            break
        for i in under:
            shares[i] = asked[i]
            remaining -= asked[i]
            left.remove(i)
    return shares


def test_the_bench_shape_is_fair_at_every_priority_in_virtual_time() -> None:
    """The queue alone, over the `flow` suite's arrivals: Jain's index of each key's served
    requests against its max-min share is >= 0.95 at every priority, the lowest included,
    where the heavy key asks 10x and the others a little more than their share (so a miss in
    the suite's full run is the wiring's or the measurement's, not the ordering's)."""
    asked, served = run_priorities()
    for priority in range(3):
        a = [asked[k, priority] for k in range(4)]
        s = [served[k, priority] for k in range(4)]
        shares = max_min_shares(a, sum(s))
        assert jain([s[i] / shares[i] for i in range(4)]) >= 0.95, (priority, s, a)
