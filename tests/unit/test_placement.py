"""Placement (DESIGN §1): least in-flight first, ties broken in rotation; a pure function."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.dataplane.placement import least_in_flight
from narwhal.fleet.state import Candidate


def _c(*pairs: tuple[str, int]) -> list[Candidate]:
    return [Candidate(id=i, in_flight=n) for i, n in pairs]


CASES: list[tuple[str, list[Candidate], int, tuple[str, ...], str | None]] = [
    ("empty", [], 0, (), None),
    ("single", _c(("a", 5)), 0, (), "a"),
    ("single-any-rotation", _c(("a", 5)), 17, (), "a"),
    ("least-wins", _c(("a", 3), ("b", 1), ("c", 2)), 0, (), "b"),
    ("least-wins-whatever-rotation", _c(("a", 3), ("b", 1), ("c", 2)), 5, (), "b"),
    ("tie-rotation-0", _c(("b", 0), ("a", 0), ("c", 4)), 0, (), "a"),
    ("tie-rotation-1", _c(("b", 0), ("a", 0), ("c", 4)), 1, (), "b"),
    ("tie-rotation-wraps", _c(("b", 0), ("a", 0), ("c", 4)), 2, (), "a"),
    ("exclude-least", _c(("a", 3), ("b", 1), ("c", 2)), 0, ("b",), "c"),
    ("exclude-all", _c(("a", 0), ("b", 0)), 0, ("a", "b"), None),
    ("exclude-unknown-id", _c(("a", 1)), 0, ("zzz",), "a"),
    ("exclude-breaks-tie", _c(("a", 0), ("b", 0)), 0, ("a",), "b"),
]


@pytest.mark.parametrize(
    ("candidates", "rotation", "exclude", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_least_in_flight(
    candidates: list[Candidate], rotation: int, exclude: tuple[str, ...], expected: str | None
) -> None:
    assert least_in_flight(candidates, rotation, exclude) == expected


def test_default_exclude_is_empty() -> None:
    assert least_in_flight(_c(("a", 2), ("b", 1)), 0) == "b"


def test_exclude_accepts_a_set() -> None:
    assert least_in_flight(_c(("a", 0), ("b", 0), ("c", 1)), 0, {"a", "b"}) == "c"


def test_rotation_visits_every_tied_engine_evenly() -> None:
    candidates = _c(("d", 2), ("c", 2), ("b", 2), ("a", 2), ("slow", 9))
    picks = Counter(least_in_flight(candidates, r) for r in range(40))
    assert picks == {"a": 10, "b": 10, "c": 10, "d": 10}


_candidates = st.lists(
    st.builds(Candidate, id=st.text("abcdef", min_size=1, max_size=3), in_flight=st.integers(0, 5)),
    max_size=8,
    unique_by=lambda c: c.id,
)


@settings(max_examples=100, deadline=None)
@given(_candidates, st.integers(-1000, 1000), st.sets(st.text("abcdef", min_size=1, max_size=3)))
def test_placement_properties(
    candidates: list[Candidate], rotation: int, exclude: set[str]
) -> None:
    before = copy.deepcopy(candidates)
    picked = least_in_flight(candidates, rotation, exclude)
    assert candidates == before, "placement mutated its snapshot"
    # Pure: the same snapshot gives the same answer, whatever the order of the candidates.
    assert least_in_flight(candidates, rotation, exclude) == picked
    assert least_in_flight(list(reversed(candidates)), rotation, frozenset(exclude)) == picked
    left = [c for c in candidates if c.id not in exclude]
    if not left:
        assert picked is None
        return
    assert picked in {c.id for c in left}
    chosen = next(c for c in left if c.id == picked)
    assert chosen.in_flight == min(c.in_flight for c in left)
