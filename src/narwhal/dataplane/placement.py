"""Placement: among eligible engines of a role, least in-flight first, ties in rotation.

A pure function over a snapshot, so other policies (prefix- or KV-aware) can be added.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from narwhal.fleet.state import Candidate


def least_in_flight(
    candidates: Sequence[Candidate], rotation: int, exclude: Collection[str] = ()
) -> str | None:
    """Pick an engine id, or None when no candidate is left."""
    pool = [c for c in candidates if c.id not in exclude]
    if not pool:
        return None
    low = min(c.in_flight for c in pool)
    ties = sorted(c.id for c in pool if c.in_flight == low)
    return ties[rotation % len(ties)]
