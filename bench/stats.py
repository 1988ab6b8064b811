"""Percentiles, medians and a bounded histogram for large sample counts."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100); NaN when empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summary(values: Iterable[float]) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {}
    return {
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "max": data[-1],
        "mean": statistics.fmean(data),
        "n": float(len(data)),
    }


def median(values: Iterable[float]) -> float:
    data = [v for v in values if not math.isnan(v)]
    return statistics.median(data) if data else math.nan


class Histogram:
    """Counts in 1 ms buckets up to `limit_ms`, one overflow bucket, and the exact maximum."""

    def __init__(self, limit_ms: int = 10_000) -> None:
        self.counts = [0] * (limit_ms + 1)
        self.n = 0
        self.max = 0.0
        self.total = 0.0

    def add(self, ms: float) -> None:
        self.counts[min(int(ms), len(self.counts) - 1)] += 1
        self.n += 1
        self.total += ms
        self.max = max(self.max, ms)

    def quantile(self, q: float) -> float:
        if not self.n:
            return math.nan
        rank = max(1, math.ceil(q / 100 * self.n))
        seen = 0
        for bucket, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return float(bucket + 1) if bucket < len(self.counts) - 1 else self.max
        return self.max

    def summary(self) -> dict[str, float]:
        if not self.n:
            return {}
        return {
            "p50": self.quantile(50),
            "p99": self.quantile(99),
            "p999": self.quantile(99.9),
            "max": self.max,
            "mean": self.total / self.n,
            "n": float(self.n),
        }
