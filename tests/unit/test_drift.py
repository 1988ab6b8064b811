"""Performance-drift decisions over closed windows: `find_drift` is pure and table-driven here.

An engine drifts in a window when it has at least `min_samples` latency samples and its p50 is
above `factor` x its role's median; it is flagged when it drifted in each of the last
`intervals` closed windows (DESIGN §3, controller stage). Roles are compared separately, and an
engine with no peer of its role (with enough samples) has nothing to drift from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest

from narwhal.control.drift import Drift, DriftSettings, find_drift
from narwhal.fleet.intervals import Window

FAST = 0.010
SLOW = 0.100  # 10x FAST
SETTINGS = DriftSettings(factor=3.0, min_samples=5, intervals=2)

# One window's samples: engine -> (number of samples, latency in seconds).
Samples = Mapping[str, tuple[int, float]]


def window(started: float, samples: Samples) -> Window:
    w = Window(started=started)
    for engine_id, (n, seconds) in samples.items():
        for _ in range(n):
            w.engine(engine_id).latency.observe(seconds)
    return w


def windows(*specs: Samples) -> list[Window]:
    return [window(float(i), s) for i, s in enumerate(specs)]


PREFILL3 = {"prefill": ["p0", "p1", "p2"]}
SLOW_P2 = {"p0": (10, FAST), "p1": (10, FAST), "p2": (10, SLOW)}
ALL_FAST = {"p0": (10, FAST), "p1": (10, FAST), "p2": (10, FAST)}


@dataclass(frozen=True)
class Case:
    name: str
    closed: list[Window]
    expected: set[str]
    roles: Mapping[str, Sequence[str]] = field(default_factory=lambda: PREFILL3)
    settings: DriftSettings = SETTINGS


CASES = [
    Case("slow in each of the last N", windows(SLOW_P2, SLOW_P2), {"p2"}),
    Case("slow in the last N of many", windows(ALL_FAST, ALL_FAST, SLOW_P2, SLOW_P2), {"p2"}),
    Case("fewer closed windows than N", windows(SLOW_P2), set()),
    Case("no closed windows", [], set()),
    Case("slow only in the older of the last N", windows(SLOW_P2, ALL_FAST), set()),
    Case("slow only in the newest of the last N", windows(ALL_FAST, SLOW_P2), set()),
    Case("slow before, recovered in the last N", windows(SLOW_P2, SLOW_P2, ALL_FAST), set()),
    Case(
        "gap in the middle of N=3",
        windows(SLOW_P2, ALL_FAST, SLOW_P2),
        set(),
        settings=DriftSettings(factor=3.0, min_samples=5, intervals=3),
    ),
    Case(
        "N=3, slow in all three",
        windows(ALL_FAST, SLOW_P2, SLOW_P2, SLOW_P2),
        {"p2"},
        settings=DriftSettings(factor=3.0, min_samples=5, intervals=3),
    ),
    Case(
        "N=1 looks at the newest window only",
        windows(ALL_FAST, SLOW_P2),
        {"p2"},
        settings=DriftSettings(factor=3.0, min_samples=5, intervals=1),
    ),
    Case(
        "below the sample minimum in every window",
        windows(*[{"p0": (10, FAST), "p1": (10, FAST), "p2": (4, SLOW)}] * 2),
        set(),
    ),
    Case(
        "below the sample minimum in one of the last N",
        windows(SLOW_P2, {"p0": (10, FAST), "p1": (10, FAST), "p2": (4, SLOW)}),
        set(),
    ),
    Case(
        "exactly the sample minimum counts",
        windows(*[{"p0": (5, FAST), "p1": (5, FAST), "p2": (5, SLOW)}] * 2),
        {"p2"},
    ),
    Case(
        "slower, but not by the factor",
        windows(*[{"p0": (10, FAST), "p1": (10, FAST), "p2": (10, 2.5 * FAST)}] * 2),
        set(),
    ),
    Case(
        "a higher factor tolerates a 10x engine",
        windows(SLOW_P2, SLOW_P2),
        set(),
        settings=DriftSettings(factor=12.0, min_samples=5, intervals=2),
    ),
    Case(
        "all equally slow: nobody drifts",
        windows(*[{"p0": (10, SLOW), "p1": (10, SLOW), "p2": (10, SLOW)}] * 2),
        set(),
    ),
    Case(
        "a faster engine never drifts",
        windows(*[{"p0": (10, SLOW), "p1": (10, SLOW), "p2": (10, FAST)}] * 2),
        set(),
    ),
    Case(
        "an engine absent from a window does not drift there",
        windows(SLOW_P2, {"p0": (10, FAST), "p1": (10, FAST)}),
        set(),
    ),
    Case(
        "two slow engines among five",
        windows(
            *[
                {
                    "p0": (10, FAST),
                    "p1": (10, FAST),
                    "p2": (10, FAST),
                    "p3": (10, SLOW),
                    "p4": (10, SLOW),
                }
            ]
            * 2
        ),
        {"p3", "p4"},
        roles={"prefill": ["p0", "p1", "p2", "p3", "p4"]},
    ),
    # Roles are compared separately: decode engines at 100 ms are normal among decode peers
    # at 100 ms; p2 is slow only against prefill peers.
    Case(
        "roles compared separately",
        windows(
            *[
                {
                    **SLOW_P2,
                    "d0": (10, SLOW),
                    "d1": (10, SLOW),
                    "d2": (10, SLOW),
                }
            ]
            * 2
        ),
        {"p2"},
        roles={"prefill": ["p0", "p1", "p2"], "decode": ["d0", "d1", "d2"]},
    ),
    Case(
        "a slow decode engine among decode peers",
        windows(
            *[
                {
                    **ALL_FAST,
                    "d0": (10, FAST),
                    "d1": (10, FAST),
                    "d2": (10, 1.0),
                }
            ]
            * 2
        ),
        {"d2"},
        roles={"prefill": ["p0", "p1", "p2"], "decode": ["d0", "d1", "d2"]},
    ),
    Case(
        "a role of slow engines does not drift against a fast other role",
        windows(
            *[
                {
                    "p0": (10, FAST),
                    "p1": (10, FAST),
                    "d0": (10, 1.0),
                    "d1": (10, 1.0),
                }
            ]
            * 2
        ),
        set(),
        roles={"prefill": ["p0", "p1"], "decode": ["d0", "d1"]},
    ),
    Case(
        "a single engine in its role is never drifting",
        windows(*[{"p0": (50, 5.0), "d0": (10, FAST), "d1": (10, FAST), "d2": (10, FAST)}] * 3),
        set(),
        roles={"prefill": ["p0"], "decode": ["d0", "d1", "d2"]},
    ),
    Case(
        "no peer with enough samples: no drift",
        windows(*[{"p0": (3, FAST), "p1": (3, FAST), "p2": (10, SLOW)}] * 2),
        set(),
    ),
    Case(
        "engines outside the role mapping are ignored",
        windows(*[{**SLOW_P2, "x9": (10, 10.0)}] * 2),
        {"p2"},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_find_drift(case: Case) -> None:
    found = find_drift(case.closed, case.roles, case.settings)
    assert {d.engine_id for d in found} == case.expected
    assert all(isinstance(d, Drift) for d in found)


def test_a_ten_times_slower_engine_drifts_against_its_one_peer() -> None:
    # Two prefill engines (the smallest PD fleet with a peer): p1 is 10x slower than p0.
    closed = windows(*[{"p0": (20, FAST), "p1": (20, SLOW)}] * 2)
    found = find_drift(closed, {"prefill": ["p0", "p1"]}, SETTINGS)
    assert [d.engine_id for d in found] == ["p1"]


def test_reason_names_the_p50_and_the_role_median() -> None:
    found = find_drift(windows(SLOW_P2, SLOW_P2), PREFILL3, SETTINGS)
    assert len(found) == 1
    reason = found[0].reason
    assert reason.startswith("p50 ")
    assert "3.0 x peers' median" in reason
    # Bucket upper bounds: 100 ms and 10 ms within one bucket.
    p50_ms = float(reason.split()[1])
    median_ms = float(reason.split("peers' median ")[1].split()[0])
    assert 100.0 <= p50_ms <= 100.0 * 10 ** (1 / 12) + 0.1
    assert 10.0 <= median_ms <= 10.0 * 10 ** (1 / 12) + 0.1


def test_find_drift_is_pure() -> None:
    closed = windows(SLOW_P2, SLOW_P2)
    before = [
        (w.started, {e: (x.requests, list(x.latency.counts)) for e, x in w.engines.items()})
        for w in closed
    ]
    first = find_drift(closed, PREFILL3, SETTINGS)
    second = find_drift(closed, PREFILL3, SETTINGS)
    assert first == second
    after = [
        (w.started, {e: (x.requests, list(x.latency.counts)) for e, x in w.engines.items()})
        for w in closed
    ]
    assert before == after
    assert len(closed) == 2


def test_each_drifting_engine_is_reported_once() -> None:
    closed = windows(*[{**SLOW_P2, "p3": (10, FAST), "p4": (10, SLOW)}] * 2)
    found = find_drift(closed, {"prefill": ["p0", "p1", "p2", "p3", "p4"]}, SETTINGS)
    ids = [d.engine_id for d in found]
    assert sorted(ids) == ["p2", "p4"]
    assert len(ids) == len(set(ids))
