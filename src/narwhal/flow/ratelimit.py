"""Rate limits per client key (DESIGN §13): requests and tokens per minute, router-wide.

Each limit is a token bucket that holds a minute's worth (the limit) and refills at a
sixtieth of it per second. A bucket is two numbers per key, and its answers are the ones
OpenAI's headers carry: what is left now (`x-ratelimit-remaining-*`) and how long until it is
full again (`x-ratelimit-reset-*`). A sliding window would need every request's time in the
last minute per key (or an approximation of it), for a reset time no client reads better.
A request is charged its estimated tokens (prompt plus `max_tokens`) when admitted; `settle`
puts back what it did not use, or takes what it used beyond. A refusal takes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from narwhal.config import KeyPolicy
from narwhal.flow.reasons import ShedReason

_PER_S = 1.0 / 60.0


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits (None: unlimited)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @classmethod
    def of(cls, policy: KeyPolicy) -> Limits:
        return cls(policy.requests_per_minute, policy.tokens_per_minute)

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None


@dataclass(frozen=True, slots=True)
class Bucket:
    """What was left at `at` (monotonic seconds); a bucket never seen is full."""

    level: float
    at: float


def level_at(bucket: Bucket | None, capacity: float, now: float) -> float:
    """The bucket's level at `now`: refilled at `capacity` per minute, up to `capacity`."""
    if bucket is None:
        return capacity
    return min(capacity, bucket.level + max(0.0, now - bucket.at) * capacity * _PER_S)


def seconds_until(level: float, wanted: float, capacity: float) -> float:
    """How long until the bucket holds `wanted` (0 when it does)."""
    return max(0.0, (wanted - level) / (capacity * _PER_S))


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI writes `x-ratelimit-reset-*` (Go's style): `20ms`, `1s`,
    `1.5s`, `6m0s`, `1h0m0s`. Rounded up to the millisecond: a reset is never early."""
    ms = math.ceil(seconds * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    text = f"{whole}" if not frac else f"{whole}.{frac:03d}".rstrip("0")
    if hours:
        return f"{hours}h{minutes}m{text}s"
    if minutes:
        return f"{minutes}m{text}s"
    return f"{text}s"


@dataclass(frozen=True, slots=True)
class Verdict:
    """A rate-limit decision. Refused: `reason` says which limit, `retry_after_s` is the
    whole seconds until this request would pass (None: never, it exceeds the limit by
    itself). `headers` are the `x-ratelimit-*` of the key's configured limits."""

    allowed: bool
    headers: Mapping[str, str]
    reason: ShedReason | None = None
    retry_after_s: int | None = None


_ALLOWED_UNLIMITED = Verdict(True, {})


class RateLimiter:
    """Every key's buckets; one for the whole router (the control process's)."""

    def __init__(self) -> None:
        self._requests: dict[str, Bucket] = {}
        self._tokens: dict[str, Bucket] = {}

    def __len__(self) -> int:
        return len(self._requests.keys() | self._tokens.keys())

    def check(self, key: str, limits: Limits, tokens: int, now: float) -> Verdict:
        """Admit one request of `tokens` estimated tokens for `key` at `now`, taking one
        request and its tokens from the buckets, or refuse it and take nothing."""
        if limits.unlimited:
            return _ALLOWED_UNLIMITED
        dims = [
            _Dim(name, float(cap), level_at(buckets.get(key), float(cap), now), wanted, buckets)
            for name, cap, wanted, buckets in (
                ("requests", limits.requests_per_minute, 1.0, self._requests),
                ("tokens", limits.tokens_per_minute, float(tokens), self._tokens),
            )
            if cap is not None
        ]
        short = [d for d in dims if d.level < d.wanted]
        if not short:
            headers: dict[str, str] = {}
            for d in dims:
                d.buckets[key] = Bucket(d.level - d.wanted, now)
                headers.update(d.headers(d.level - d.wanted))
            return Verdict(True, headers)
        headers = {k: v for d in dims for k, v in d.headers(d.level).items()}
        never = [d for d in short if d.wanted > d.capacity]  # beyond a whole minute's worth
        if never:
            return Verdict(False, headers, _REASONS[never[0].name], None)
        wait_s = max(d.seconds_until_enough() for d in short)
        return Verdict(False, headers, _REASONS[short[0].name], max(1, math.ceil(wait_s)))

    def settle(self, key: str, limits: Limits, estimated: int, used: int, now: float) -> None:
        """A request admitted with `estimated` tokens used `used`: put the difference back
        (or take it: the bucket may go below zero, and the key waits it out)."""
        cap = limits.tokens_per_minute
        if cap is None or estimated == used:
            return
        level = level_at(self._tokens.get(key), float(cap), now)
        self._tokens[key] = Bucket(min(float(cap), level + estimated - used), now)

    def prune(self, now: float, limits_of: Callable[[str], Limits]) -> int:
        """Forget buckets that are full again (a full bucket is the same as none), and those
        of keys no longer limited. Returns how many were forgotten."""
        gone = 0
        for name, buckets in (("requests", self._requests), ("tokens", self._tokens)):
            for key in list(buckets):
                limits = limits_of(key)
                cap = limits.requests_per_minute if name == "requests" else limits.tokens_per_minute
                if cap is None or level_at(buckets[key], float(cap), now) >= cap:
                    del buckets[key]
                    gone += 1
        return gone


_REASONS = {
    "requests": ShedReason.REQUESTS_PER_MINUTE,
    "tokens": ShedReason.TOKENS_PER_MINUTE,
}


@dataclass(frozen=True, slots=True)
class _Dim:
    """One limit of one key, during one check."""

    name: str  # requests or tokens, as in the headers' names
    capacity: float
    level: float
    wanted: float
    buckets: dict[str, Bucket]

    def seconds_until_enough(self) -> float:
        return seconds_until(self.level, self.wanted, self.capacity)

    def headers(self, level: float) -> dict[str, str]:
        name, cap = self.name, self.capacity
        return {
            f"x-ratelimit-limit-{name}": str(int(cap)),
            f"x-ratelimit-remaining-{name}": str(max(0, math.floor(level))),
            f"x-ratelimit-reset-{name}": openai_duration(seconds_until(level, cap, cap)),
        }
