"""Per-engine interval statistics in bounded memory (DESIGN §3, controller and rollover stages).

`Histogram` answers quantiles within one bucket of resolution (12 buckets per decade, about
21 %), never grows, and `roll` is a pure function of the open window, `now` and the interval.
"""

from __future__ import annotations

import math
import random

import pytest

from narwhal.fleet.intervals import EngineWindow, Histogram, IntervalStats, Window, roll

# One bucket: the bounds are 1e-4 * 10 ** (i / 12).
STEP = 10 ** (1 / 12)


def exact_quantile(samples: list[float], q: float) -> float:
    """The nearest-rank quantile the histogram approximates."""
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


# --------------------------------------------------------------------------- Histogram
def test_empty_histogram_has_no_quantile() -> None:
    h = Histogram()
    assert h.total == 0
    assert h.quantile(0.5) is None
    assert h.quantile(0.99) is None


@pytest.mark.parametrize("seconds", [0.0002, 0.00123, 0.004, 0.0173, 0.05, 0.25, 1.0, 3.7, 42.0])
def test_quantile_of_one_value_is_within_one_bucket(seconds: float) -> None:
    h = Histogram()
    for _ in range(25):
        h.observe(seconds)
    for q in (0.01, 0.5, 0.99, 1.0):
        got = h.quantile(q)
        assert got is not None
        # The bucket's upper bound: never below the value, at most one bucket above it.
        assert seconds <= got * (1 + 1e-9)
        assert got <= seconds * STEP * (1 + 1e-9)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("q", [0.1, 0.5, 0.9, 0.99])
def test_quantiles_of_a_spread_are_within_bucket_resolution(seed: int, q: float) -> None:
    rng = random.Random(seed)
    # Log-uniform between 1 ms and 2 s: every decade is populated.
    samples = [10 ** rng.uniform(-3, math.log10(2.0)) for _ in range(5000)]
    h = Histogram()
    for s in samples:
        h.observe(s)
    truth = exact_quantile(samples, q)
    got = h.quantile(q)
    assert got is not None
    assert truth <= got * (1 + 1e-9), (q, truth, got)
    assert got <= truth * STEP * (1 + 1e-9), (q, truth, got)


def test_quantiles_are_monotonic_in_q() -> None:
    rng = random.Random(7)
    h = Histogram()
    for _ in range(2000):
        h.observe(rng.expovariate(50.0))
    values = [h.quantile(q) for q in (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)]
    assert all(v is not None for v in values)
    assert values == sorted(values)  # type: ignore[type-var]


def test_a_slow_and_a_fast_population_are_told_apart() -> None:
    fast, slow = Histogram(), Histogram()
    for _ in range(50):
        fast.observe(0.010)
        slow.observe(0.100)
    fast_p50, slow_p50 = fast.quantile(0.5), slow.quantile(0.5)
    assert fast_p50 is not None and slow_p50 is not None
    assert 9.0 < slow_p50 / fast_p50 < 11.0


def test_a_million_observations_keep_the_same_memory() -> None:
    h = Histogram()
    length = len(h.counts)
    for i in range(1_000_000):
        h.observe(0.0001 * (1 + i % 5000))
    assert len(h.counts) == length
    assert h.total == 1_000_000
    assert sum(h.counts) == 1_000_000
    assert not hasattr(h, "__dict__")  # slots: no room to hoard samples on the side


def test_extreme_values_land_in_the_edge_buckets() -> None:
    h = Histogram()
    length = len(h.counts)
    h.observe(0.0)
    h.observe(1e-9)
    h.observe(1e6)
    assert len(h.counts) == length
    assert h.counts[0] == 2
    assert h.counts[-1] == 1
    assert h.total == 3


# --------------------------------------------------------------------------- EngineWindow
def test_engine_window_json() -> None:
    w = EngineWindow()
    w.requests = 4
    w.failures["timeout"] = 2
    for _ in range(3):
        w.latency.observe(0.02)
    w.inter_token.observe(0.002)
    body = w.to_json()
    assert body["requests"] == 4
    assert body["failures"] == {"timeout": 2}
    assert body["latency_samples"] == 3
    assert 0.02 <= body["latency_p50_s"] <= 0.02 * STEP
    assert 0.02 <= body["latency_p99_s"] <= 0.02 * STEP
    assert 0.002 <= body["inter_token_p50_s"] <= 0.002 * STEP
    empty = EngineWindow().to_json()
    assert empty["latency_p50_s"] is None
    assert empty["latency_samples"] == 0


# --------------------------------------------------------------------------- roll (pure)
@pytest.mark.parametrize(
    ("interval_s", "elapsed", "closes"),
    [
        (30.0, 0.0, False),
        (30.0, 29.999, False),
        (30.0, 30.0, True),
        (30.0, 30.001, True),
        (30.0, 95.0, True),
        (0.5, 0.4999, False),
        (0.5, 0.5, True),
    ],
)
def test_roll_closes_exactly_at_the_interval(
    interval_s: float, elapsed: float, closes: bool
) -> None:
    started = 1000.0
    current = Window(started=started)
    current.engine("p0").requests = 3
    now = started + elapsed
    opened, closed = roll(current, now, interval_s)
    if closes:
        assert closed is current
        assert opened is not current
        assert opened.started == now
        assert opened.engines == {}
    else:
        assert closed is None
        assert opened is current
    # Pure: the window passed in is never changed.
    assert current.started == started
    assert current.engines["p0"].requests == 3


def test_roll_is_repeatable() -> None:
    current = Window(started=10.0)
    a = roll(current, 40.0, 30.0)
    b = roll(current, 40.0, 30.0)
    assert a[1] is b[1] is current
    assert a[0].started == b[0].started == 40.0


# --------------------------------------------------------------------------- IntervalStats
def test_interval_stats_records_into_the_open_window() -> None:
    stats = IntervalStats(interval_s=30.0, now=0.0)
    stats.request("p0")
    stats.request("p0")
    stats.failure("p0", "timeout")
    stats.failure("p0", "timeout")
    stats.failure("d0", "stream")
    stats.latency("p0", 0.01)
    stats.inter_token("d0", 0.002)
    p0 = stats.current.engines["p0"]
    d0 = stats.current.engines["d0"]
    assert p0.requests == 2
    assert p0.failures == {"timeout": 2}
    assert p0.latency.total == 1
    assert d0.failures == {"stream": 1}
    assert d0.inter_token.total == 1
    assert d0.requests == 0
    assert list(stats.closed) == []


def test_rollover_closes_at_the_interval_and_not_before() -> None:
    stats = IntervalStats(interval_s=30.0, now=100.0)
    stats.request("p0")
    assert stats.rollover(100.0) is None
    assert stats.rollover(129.999) is None
    assert list(stats.closed) == []
    closed = stats.rollover(130.0)
    assert closed is not None
    assert closed.started == 100.0
    assert closed.engines["p0"].requests == 1
    assert list(stats.closed) == [closed]
    # The new window starts empty at the rollover time.
    assert stats.current.started == 130.0
    assert stats.current.engines == {}
    stats.request("p0")
    assert stats.rollover(159.0) is None
    assert stats.rollover(160.0) is not None
    assert [w.started for w in stats.closed] == [100.0, 130.0]


@pytest.mark.parametrize("keep", [1, 3, 10])
def test_interval_stats_keeps_at_most_keep_closed_windows(keep: int) -> None:
    stats = IntervalStats(interval_s=1.0, now=0.0, keep=keep)
    for i in range(1, 26):
        stats.request("p0")
        assert stats.rollover(float(i)) is not None
        assert len(stats.closed) == min(i, keep)
    # The newest windows are kept, oldest first.
    assert [w.started for w in stats.closed] == [float(i) for i in range(25 - keep, 25)]


def test_default_keep_is_bounded() -> None:
    stats = IntervalStats(interval_s=1.0, now=0.0)
    for i in range(1, 1001):
        stats.rollover(float(i))
    assert len(stats.closed) == 10
