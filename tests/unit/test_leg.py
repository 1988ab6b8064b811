"""`Leg.with_body` is `dataclasses.replace(leg, body=...)` written out (the hot path's), so a
field added to `Leg` and forgotten there fails here."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, cast

from narwhal.dataplane.leg import Attempt, Leg


def test_with_body_keeps_every_other_field() -> None:
    values: dict[str, Any] = {f.name: object() for f in fields(Leg)}
    values["attempt"] = Attempt("r1", {})
    leg = Leg(**values)
    body = {"prompt": "x"}
    moved = leg.with_body(body)
    assert moved.body is body
    expected = replace(leg, body=body)
    for f in fields(Leg):
        assert getattr(moved, f.name) is getattr(expected, f.name), f.name
    assert cast(Any, leg).body is values["body"]  # the original is untouched
