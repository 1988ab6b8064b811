"""Performance drift: an engine much slower than its role's median, interval after interval.

`find_drift` is a pure function over closed windows: an engine drifts in an interval when
it has at least `min_samples` latency samples and its median is above `factor` times the
median of its role's other engines (that also have enough samples); it is flagged when it
drifted in each of the last `intervals` closed windows.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from narwhal.fleet.intervals import Window


@dataclass(frozen=True, slots=True)
class DriftSettings:
    factor: float
    min_samples: int
    intervals: int


@dataclass(frozen=True, slots=True)
class Drift:
    engine_id: str
    reason: str


def _drifting(window: Window, members: Sequence[str], s: DriftSettings) -> dict[str, str]:
    medians: dict[str, float] = {}
    for engine_id in members:
        w = window.engines.get(engine_id)
        if w is None or w.latency.total < s.min_samples:
            continue
        p50 = w.latency.quantile(0.5)
        if p50 is not None:
            medians[engine_id] = p50
    if len(medians) < 2:
        return {}
    out = {}
    for engine_id, m in medians.items():
        # Compare with the median of the *other* engines: with two engines, a role median
        # that includes the engine judged could never be exceeded by a factor >= 2.
        peers = statistics.median(v for e, v in medians.items() if e != engine_id)
        if m > s.factor * peers:
            out[engine_id] = (
                f"p50 {m * 1000:.1f} ms > {s.factor} x peers' median {peers * 1000:.1f} ms"
            )
    return out


def find_drift(
    closed: Sequence[Window], roles: Mapping[str, Sequence[str]], s: DriftSettings
) -> list[Drift]:
    """Engines drifting in every one of the last `s.intervals` closed windows."""
    if len(closed) < s.intervals:
        return []
    recent = list(closed)[-s.intervals :]
    found: dict[str, Drift] = {}  # an engine serving two roles is reported once
    for members in roles.values():
        per_window = [_drifting(w, members, s) for w in recent]
        for engine_id in members:
            if engine_id not in found and all(engine_id in d for d in per_window):
                found[engine_id] = Drift(engine_id, per_window[-1][engine_id])
    return list(found.values())
