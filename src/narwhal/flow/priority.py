"""A request's priority (DESIGN §13): the body's `priority` as vLLM defines it (an integer,
lower served first), else its client key's `priority`, else 0.

vLLM's own field takes any integer (a whole number written as `2.0` too); Narwhal keeps it to
32 bits. Anything else is the client's error, answered 400 naming `priority`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from narwhal.config import PRIORITY_MAX, PRIORITY_MIN


class PriorityError(ValueError):
    """The body's `priority` is not one: a 400 with `param: priority` and this message."""

    param = "priority"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _kind(value: Any) -> str:
    """The JSON kind of a parsed value, as a client would name it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def resolve_priority(body: Mapping[str, Any], key_priority: int = 0) -> int:
    """The request's priority: its body's `priority` (absent or null: `key_priority`, the
    client key's policy's, whose own default is 0)."""
    value = body.get("priority")
    if value is None:
        return key_priority
    if isinstance(value, float) and not isinstance(value, bool) and value.is_integer():
        value = int(value)
    if type(value) is not int:
        raise PriorityError(
            f"Invalid 'priority': expected an integer (lower is served first), got {_kind(value)}."
        )
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise PriorityError(
            f"Invalid 'priority': {value} is out of range "
            f"({PRIORITY_MIN} to {PRIORITY_MAX}; lower is served first)."
        )
    return value
