"""Per-engine statistics over fixed intervals, in bounded memory.

Latencies go into fixed log-spaced histograms (no lists of samples). `rollover` closes the
current window when `controller.interval_s` has passed; closing is a pure function of the
window and `now`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# 0.1 ms .. ~100 s, 12 buckets per decade: ~21% resolution, 73 counters per histogram.
_BOUNDS_S = tuple(1e-4 * 10 ** (i / 12) for i in range(73))


@dataclass(slots=True)
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(_BOUNDS_S) + 1))
    total: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_BOUNDS_S, seconds)] += 1
        self.total += 1

    def sparse(self) -> list[list[int]]:
        """The non-zero buckets as `[index, count]` pairs (what a worker ships)."""
        return [[i, n] for i, n in enumerate(self.counts) if n]

    def merge(self, sparse: list[list[int]]) -> None:
        for i, n in sparse:
            self.counts[i] += n
            self.total += n

    def quantile(self, q: float) -> float | None:
        """The bucket upper bound below which a fraction `q` of samples fall."""
        if self.total == 0:
            return None
        rank = max(1, math.ceil(q * self.total))
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return _BOUNDS_S[min(i, len(_BOUNDS_S) - 1)]
        return _BOUNDS_S[-1]


@dataclass(slots=True)
class EngineWindow:
    requests: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latency: Histogram = field(default_factory=Histogram)  # prefill leg or decode TTFT
    inter_token: Histogram = field(default_factory=Histogram)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "failures": dict(self.failures),
            "latency_p50_s": self.latency.quantile(0.5),
            "latency_p99_s": self.latency.quantile(0.99),
            "latency_samples": self.latency.total,
            "inter_token_p50_s": self.inter_token.quantile(0.5),
        }


@dataclass(slots=True)
class Window:
    started: float
    engines: dict[str, EngineWindow] = field(default_factory=dict)

    def engine(self, engine_id: str) -> EngineWindow:
        w = self.engines.get(engine_id)
        if w is None:
            w = self.engines[engine_id] = EngineWindow()
        return w


def roll(current: Window, now: float, interval_s: float) -> tuple[Window, Window | None]:
    """(the open window, the window just closed or None): pure."""
    if now - current.started < interval_s:
        return current, None
    return Window(started=now), current


class IntervalStats:
    """The open window plus the last `keep` closed ones."""

    def __init__(self, interval_s: float, now: float, keep: int = 10) -> None:
        self._interval_s = interval_s
        self.current = Window(started=now)
        self.closed: deque[Window] = deque(maxlen=keep)

    def request(self, engine_id: str) -> None:
        self.current.engine(engine_id).requests += 1

    def failure(self, engine_id: str, failure_class: str) -> None:
        failures = self.current.engine(engine_id).failures
        failures[failure_class] = failures.get(failure_class, 0) + 1

    def latency(self, engine_id: str, seconds: float) -> None:
        self.current.engine(engine_id).latency.observe(seconds)

    def inter_token(self, engine_id: str, seconds: float) -> None:
        self.current.engine(engine_id).inter_token.observe(seconds)

    def take(self, now: float) -> Window:
        """The open window's counts so far, starting a fresh one: a worker ships these to
        the control process, which `merge`s them into its own windows."""
        taken, self.current = self.current, Window(started=now)
        return taken

    def merge(
        self,
        engine_id: str,
        requests: int,
        latency: list[list[int]],
        inter_token: list[list[int]],
    ) -> None:
        w = self.current.engine(engine_id)
        w.requests += requests
        w.latency.merge(latency)
        w.inter_token.merge(inter_token)

    def rollover(self, now: float) -> Window | None:
        self.current, closed = roll(self.current, now, self._interval_s)
        if closed is not None:
            self.closed.append(closed)
        return closed
