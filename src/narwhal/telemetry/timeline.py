"""A short history of request rate and latency for the dashboard, in bounded memory."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from narwhal.fleet.intervals import Histogram

_NOT_ERRORS = frozenset({"ok", "bad_request", "client_error", "client_disconnect"})


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    requests: int
    errors: int
    latency_p50_s: float | None
    latency_p99_s: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "requests": self.requests,
            "errors": self.errors,
            "latency_p50_s": self.latency_p50_s,
            "latency_p99_s": self.latency_p99_s,
        }


class Timeline:
    def __init__(self, keep: int = 300) -> None:
        self.samples: deque[Sample] = deque(maxlen=keep)
        self._requests = 0
        self._errors = 0
        self._latency = Histogram()

    def request(self, outcome: str, latency_s: float) -> None:
        self._requests += 1
        if outcome not in _NOT_ERRORS:
            self._errors += 1
        self._latency.observe(latency_s)

    def take(self) -> tuple[int, int, list[list[int]]]:
        """Requests, errors and sparse latency buckets since the last take (a worker's
        share, shipped to the control process), starting afresh."""
        taken = (self._requests, self._errors, self._latency.sparse())
        self._requests = self._errors = 0
        self._latency = Histogram()
        return taken

    def merge(self, requests: int, errors: int, latency: list[list[int]]) -> None:
        self._requests += requests
        self._errors += errors
        self._latency.merge(latency)

    def sample(self, wall: float) -> None:
        self.samples.append(
            Sample(
                wall,
                self._requests,
                self._errors,
                self._latency.quantile(0.5),
                self._latency.quantile(0.99),
            )
        )
        self._requests = self._errors = 0
        self._latency = Histogram()
