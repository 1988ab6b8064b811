"""A request's priority (flow/priority.py): the body's, else the key's, else 0."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.flow.priority import PriorityError, resolve_priority


@pytest.mark.parametrize(
    ("body", "key_priority", "want"),
    [
        ({}, 0, 0),
        ({}, 3, 3),
        ({"priority": None}, 3, 3),  # null: not given
        ({"priority": 0}, 3, 0),  # the body's wins, 0 included
        ({"priority": -5}, 3, -5),
        ({"priority": 2.0}, 0, 2),  # vLLM takes a whole number written as a float
        ({"priority": 2**31 - 1}, 0, 2**31 - 1),
        ({"priority": -(2**31)}, 0, -(2**31)),
    ],
)
def test_resolved(body: dict[str, Any], key_priority: int, want: int) -> None:
    got = resolve_priority(body, key_priority)
    assert got == want and type(got) is int


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("1", "got a string"),
        (True, "got a boolean"),
        (1.5, "got the number 1.5"),
        ([1], "got an array"),
        ({"a": 1}, "got an object"),
        (2**31, "out of range"),
        (-(2**31) - 1, "out of range"),
        (1e300, "out of range"),
    ],
)
def test_refused_with_a_400_naming_priority(value: Any, words: str) -> None:
    with pytest.raises(PriorityError) as info:
        resolve_priority({"priority": value})
    assert info.value.param == "priority"
    assert words in info.value.message and "lower is served first" in info.value.message
