"""The `flow` suite's pure parts: Jain's index against min(demand, fair share), the targets'
verdicts, the refusal delay, and the open-loop schedule (bench.report.flow,
bench.loadgen.flow)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from bench.loadgen.flow import FlowClass, FlowSpec, refusal_reason, schedule
from bench.report.flow import (
    analyze,
    fair_shares,
    fairness,
    jain,
    render,
    shed_latency_ms,
    verdicts,
)
from bench.suites.flow import TRAFFIC, capacity_rps, classes


def test_jain_is_one_when_equal_and_one_over_n_when_one_has_everything() -> None:
    assert jain([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain([2.0, 1.0]) == pytest.approx(9 / 10)
    assert jain([]) is None
    assert jain([0.0, 0.0]) is None


def test_fair_shares_give_a_light_client_what_it_asks_and_split_the_rest() -> None:
    shares = fair_shares({"heavy": 100.0, "a": 10.0, "b": 10.0, "c": 40.0}, 100.0)
    assert shares["a"] == pytest.approx(10.0)
    assert shares["b"] == pytest.approx(10.0)
    assert shares["c"] == pytest.approx(40.0)  # 80 left for two: 40 each, c asked 40
    assert shares["heavy"] == pytest.approx(40.0)
    assert sum(shares.values()) == pytest.approx(100.0)


def test_fair_shares_split_evenly_when_everyone_asks_more_and_give_all_when_enough() -> None:
    assert fair_shares({"x": 50.0, "y": 80.0}, 40.0) == {
        "x": pytest.approx(20.0),
        "y": pytest.approx(20.0),
    }
    assert fair_shares({"x": 5.0, "y": 8.0}, 13.0) == {"x": 5.0, "y": 8.0}


def test_fairness_does_not_punish_a_key_that_asked_less_than_an_equal_split() -> None:
    demand = {0: 1000.0, 1: 50.0, 2: 300.0, 3: 300.0}
    # max-min fair: 50 to key 1, 250 to the others (total 800)
    fair = {0: 250.0, 1: 50.0, 2: 250.0, 3: 250.0}
    assert fairness(fair, demand) == pytest.approx(1.0)
    # Jain's index over raw served tokens would call the same allocation unfair
    assert (jain(fair.values()) or 0) < 0.9
    # the heavy key taking the light ones' share is caught
    greedy = {0: 500.0, 1: 50.0, 2: 125.0, 3: 125.0}
    index = fairness(greedy, demand)
    assert index is not None and index < 0.95


def test_fairness_leaves_out_keys_that_asked_nothing_and_is_none_when_nothing_served() -> None:
    assert fairness({0: 10.0, 1: 10.0}, {0: 20.0, 1: 20.0, 2: 0.0}) == pytest.approx(1.0)
    assert fairness({}, {0: 20.0, 1: 20.0}) is None


def _suite(arms: list[dict[str, Any]], flow_s: float = 10.0) -> dict[str, Any]:
    return {
        "arms": arms,
        "flow_s": flow_s,
        "fleet": {"max_tokens": 10},
        "max_wait_s": 5,
        "slo_factor": 4.0,
    }


def _rec(
    sent: float,
    key: int,
    prio: int,
    status: int = 200,
    latency: float = 0.5,
    ttft: float | None = 0.05,
    tokens: int = 10,
    reason: str = "",
) -> list[Any]:
    if status != 200:
        ttft, tokens = None, 0
    return [sent, key, prio, status, latency, ttft, tokens, reason]


def _verdicts(arm: list[list[Any]], base: list[list[Any]]) -> dict[str, list[str]]:
    unloaded = [_rec(0.0, 1, 0, ttft=0.05)]
    suite = _suite(
        [
            {"arm": "narwhal-flow", "records": arm, "unloaded": unloaded},
            {"arm": "narwhal-flow-off", "records": base, "unloaded": unloaded},
        ]
    )
    rows = {a["arm"]: analyze(a, suite, 200.0) for a in suite["arms"]}
    out = {}
    for v in verdicts(rows, 200.0):
        head = v[0].split(" (")[0]
        out["ttft" if "TTFT" in head else head.split(":")[0]] = v
    return out


def test_verdicts_meet_every_target_when_the_run_is_clean() -> None:
    arm = [_rec(i * 0.1, i % 4, 0) for i in range(40)]
    arm += [_rec(1.0, k, 2) for k in range(4)]
    arm += [_rec(1.0, 0, 2, status=429, latency=5.01, reason="deadline")]
    arm += [_rec(1.0, 1, 2, status=429, latency=0.004, reason="queue_full")]
    got = _verdicts(arm, list(arm))
    assert all(v[-1] == "met" for v in got.values()), got
    assert got["ttft"][1].startswith("100.0% of 40")
    assert got["priority 2"][1] == "1.000"


def test_the_preemption_arm_is_judged_in_its_own_table_against_the_same_slo() -> None:
    unloaded = [_rec(0.0, 1, 0, ttft=0.05)]
    late = [_rec(i * 0.1, i % 4, 0, ttft=0.3 if i < 4 else 0.05) for i in range(40)]
    prompt = [_rec(i * 0.1, i % 4, 0) for i in range(40)]
    slow = [_rec(0.0, 1, 0, ttft=1.0)]  # its own unloaded TTFT: not the SLO's base
    suite = {
        **_suite(
            [
                {"arm": "narwhal-flow", "records": late, "unloaded": unloaded},
                {"arm": "narwhal-flow-preempt", "records": prompt, "unloaded": slow},
                {"arm": "narwhal-flow-off", "records": late, "unloaded": unloaded},
            ]
        ),
        "fleet": {"max_tokens": 10, "max_concurrency": 8, "itl_ms": 20, "prompt_words": 32,
                  "capacity_rps": 25.0},
        "unloaded_s": 5, "unloaded_load": 0.1, "overload": 2.0, "traffic": [[0, 0, 1.0]],
        "queue_limit": 1024, "heavy_key": 0,
    }  # fmt: skip
    text = render(suite)
    judged, _, rest = text.partition("### Targets (`narwhal-flow-preempt`")
    preempt = rest.partition("### Side by side")[0]
    assert "200 ms (4x unloaded)" in judged and "**missed**" in judged  # 90% within
    # The SLO is the default arm's (50 ms unloaded x 4), not the preemption arm's own.
    assert "200 ms (4x unloaded)" in preempt and "100.0% of 40" in preempt


def test_verdicts_say_missed_with_the_number() -> None:
    arm = [_rec(i * 0.1, i % 4, 0, ttft=0.3 if i < 2 else 0.05) for i in range(40)]
    arm += [_rec(2.0, 0, 0, status=503)]  # a 5xx
    arm += [_rec(2.0, 0, 0, status=-1, latency=12.0, reason="hung")]
    arm += [_rec(1.0, 0, 2, status=429, latency=5.2, reason="deadline")]  # 200 ms late
    base = [_rec(i * 0.05, i % 4, 1) for i in range(80)]  # flow off served twice the tokens
    got = _verdicts(arm, base)
    assert got["ttft"][-1] == "**missed**"
    assert got["ttft"][1].startswith("90.5% of 42")  # 38 of 42 within 200 ms
    served = got["every request served or refused 429"]
    assert served[-1] == "**missed**" and "1 5xx" in served[1] and "1 hung" in served[1]
    shed = got["429 within 50 ms of being shed"]
    assert shed[-1] == "**missed**" and "200.0 ms" in shed[1]
    tokens = got["output tokens/s ≥ 95% of flow control off"]
    assert tokens[-1] == "**missed**" and "(50%)" in tokens[1]


def test_jain_verdict_misses_when_the_heavy_key_takes_the_light_keys_share() -> None:
    arm = [_rec(0.1 * i, 0, 2) for i in range(30)]  # heavy: 30 served
    for k in (1, 2, 3):
        arm += [_rec(0.1 * i, k, 2) for i in range(2)]  # light: 2 served of 10 asked
        arm += [_rec(0.1 * i, k, 2, status=429, latency=5.0, reason="deadline") for i in range(8)]
    arm += [_rec(0.1 * i, 0, 2, status=429, latency=5.0, reason="deadline") for i in range(70)]
    got = _verdicts(arm, list(arm))
    verdict = got["priority 2"]
    assert verdict[-1] == "**missed**"
    assert float(verdict[1]) < 0.95


def test_shed_delay_counts_a_deadline_refusal_from_its_deadline_and_others_from_arrival() -> None:
    records = [
        _rec(0, 0, 2, status=429, latency=5.03, reason="deadline"),
        _rec(0, 0, 2, status=429, latency=0.002, reason="queue_full"),
        _rec(0, 0, 2, status=429, latency=0.5, reason="other"),
        _rec(0, 0, 2),
    ]
    assert shed_latency_ms(records, 5.0) == pytest.approx([30.0, 2.0, 500.0])


def test_refusal_reason_reads_narwhal_s_messages() -> None:
    def body(message: str) -> bytes:
        return json.dumps({"error": {"message": message}}).encode()

    assert refusal_reason(body("The server is overloaded: the queue is full. Please")) == (
        "queue_full"
    )
    assert refusal_reason(body("could not start within its wait limit.")) == "deadline"
    assert refusal_reason(body("Rate limit reached for requests per minute")) == "rate_limit"
    assert refusal_reason(b"Too Many Requests") == "other"


def test_schedule_is_the_same_for_every_arm_and_close_to_its_rates() -> None:
    spec = FlowSpec(
        "s",
        "http://x",
        "m",
        ("a", "b"),
        (FlowClass(0, 0, 20.0), FlowClass(1, 2, 5.0)),
        duration_s=100.0,
        deadline_s=1.0,
    )
    arrivals = schedule(spec)
    assert arrivals == schedule(FlowSpec.from_json(json.loads(json.dumps(spec.to_json()))))
    assert [t for t, _ in arrivals] == sorted(t for t, _ in arrivals)
    heavy = sum(1 for _, c in arrivals if c.key == 0)
    light = sum(1 for _, c in arrivals if c.key == 1)
    assert 1800 < heavy < 2200 and 400 < light < 600
    assert all(0 <= t < 100.0 for t, _ in arrivals)


def test_the_suite_offers_twice_the_capacity_with_one_key_at_ten_times_at_priority_two() -> None:
    assert sum(c.rate_per_s for c in classes(2.0)) == pytest.approx(2 * capacity_rps())
    batch = {k: share for (k, p), share in TRAFFIC.items() if p == 2}
    assert batch[0] == pytest.approx(10 * batch[1]) and batch[1] == batch[2] == batch[3]


def test_the_drain_after_the_overload_is_not_counted_as_the_heavy_key_s_share() -> None:
    """Once arrivals stop the queue drains what is left, mostly the heaviest key's: answers
    whose first token comes after the window do not count toward the shares."""
    suite = _suite([])
    window = suite["flow_s"]
    arm = [_rec(window - 1.0, k, 2) for k in range(4) for _ in range(5)]  # 5 each, in time
    # the light keys asked for more: the rest of theirs expired in the queue
    arm += [
        _rec(window - 1.0, k, 2, status=429, latency=5.0, reason="deadline")
        for k in (1, 2, 3)
        for _ in range(5)
    ]
    # the heavy key's queued requests, served after the arrivals stopped
    arm += [_rec(window - 0.5, 0, 2, ttft=2.0, latency=2.5) for _ in range(20)]
    got = _verdicts(arm, list(arm))
    assert got["priority 2"][1] == "1.000", got["priority 2"]
