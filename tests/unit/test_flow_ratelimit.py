"""Per-key rate limits (flow/ratelimit.py): token buckets of a minute's worth, and the
`x-ratelimit-*` headers in OpenAI's format."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.config import KeyPolicy
from narwhal.flow.ratelimit import Limits, RateLimiter, openai_duration
from narwhal.flow.reasons import ShedReason


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.0004, "1ms"),  # rounded up: a reset is never early
        (0.02, "20ms"),
        (0.999, "999ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.9991, "1m0s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (90.5, "1m30.5s"),
        (3600.0, "1h0m0s"),
        (3723.0, "1h2m3s"),
    ],
)
def test_openai_duration(seconds: float, text: str) -> None:
    assert openai_duration(seconds) == text


def test_requests_per_minute() -> None:
    rl, limits = RateLimiter(), Limits(requests_per_minute=3)
    verdicts = [rl.check("k", limits, 0, now=0.0) for _ in range(4)]
    assert [v.allowed for v in verdicts] == [True, True, True, False]
    assert verdicts[0].headers == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "20s",  # one request back every 20 s
    }
    refused = verdicts[3]
    assert refused.reason is ShedReason.REQUESTS_PER_MINUTE and refused.retry_after_s == 20
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert rl.check("k", limits, 0, now=19.9).allowed is False
    assert rl.check("k", limits, 0, now=20.0).allowed is True
    assert rl.check("other", limits, 0, now=0.0).allowed  # per key


def test_tokens_per_minute_and_a_refusal_takes_nothing() -> None:
    rl, limits = RateLimiter(), Limits(requests_per_minute=100, tokens_per_minute=1000)
    assert rl.check("k", limits, 900, 0.0).allowed
    refused = rl.check("k", limits, 200, 0.0)
    assert (refused.allowed, refused.reason) == (False, ShedReason.TOKENS_PER_MINUTE)
    assert refused.retry_after_s == 6  # 100 tokens short at 1000/60 per second
    assert refused.headers["x-ratelimit-remaining-requests"] == "99"  # not charged
    assert refused.headers["x-ratelimit-remaining-tokens"] == "100"
    ok = rl.check("k", limits, 100, 0.0)
    assert ok.allowed and ok.headers["x-ratelimit-remaining-tokens"] == "0"
    assert ok.headers["x-ratelimit-reset-tokens"] == "1m0s"
    assert set(ok.headers) == {
        f"x-ratelimit-{what}-{dim}"
        for what in ("limit", "remaining", "reset")
        for dim in ("requests", "tokens")
    }


def test_a_request_beyond_a_minutes_worth_never_passes() -> None:
    rl = RateLimiter()
    refused = rl.check("k", Limits(tokens_per_minute=1000), 1001, 0.0)
    assert (refused.allowed, refused.reason, refused.retry_after_s) == (
        False,
        ShedReason.TOKENS_PER_MINUTE,
        None,
    )


def test_settle_puts_back_what_was_not_used() -> None:
    rl, limits = RateLimiter(), Limits(tokens_per_minute=1000)
    assert rl.check("k", limits, 800, 0.0).allowed  # prompt plus max_tokens
    assert not rl.check("k", limits, 500, 0.0).allowed
    rl.settle("k", limits, estimated=800, used=300, now=0.0)
    assert rl.check("k", limits, 500, 0.0).allowed
    rl.settle("k", limits, estimated=500, used=1500, now=0.0)  # used more: owed
    refused = rl.check("k", limits, 1, 0.0)
    assert not refused.allowed and refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert refused.retry_after_s == 49  # at -800: 801 tokens to earn back at 1000 a minute
    assert refused.headers["x-ratelimit-reset-tokens"] == "1m48s"  # 1800 to full


def test_unlimited_keys_pass_without_headers_or_state() -> None:
    rl = RateLimiter()
    v = rl.check("k", Limits.of(KeyPolicy()), 10**9, 0.0)
    assert v.allowed and v.headers == {} and len(rl) == 0


def test_prune_forgets_full_buckets() -> None:
    rl, limits = RateLimiter(), Limits(requests_per_minute=60, tokens_per_minute=600)
    rl.check("a", limits, 60, 0.0)
    rl.check("b", limits, 600, 0.0)
    assert rl.prune(6.0, lambda key: limits) == 3  # all but b's tokens are full again
    assert len(rl) == 1
    assert rl.prune(60.0, lambda key: limits) == 1 and len(rl) == 0


@settings(max_examples=200, deadline=None)
@given(
    rpm=st.integers(1, 50),
    gaps=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=200),
)
def test_never_more_than_a_minutes_worth_in_any_minute(rpm: int, gaps: list[float]) -> None:
    """Over any 60 s, at most twice the limit passes (a full bucket plus a minute's refill),
    and from a cold start at most the limit plus what refilled."""
    rl, limits = RateLimiter(), Limits(requests_per_minute=rpm)
    now, passed = 0.0, []
    for gap in gaps:
        now += gap
        if rl.check("k", limits, 0, now).allowed:
            passed.append(now)
    for i, t in enumerate(passed):
        in_window = sum(1 for u in passed[i:] if u < t + 60.0)
        assert in_window <= 2 * rpm
        assert sum(1 for u in passed if u <= t) <= rpm + t * rpm / 60.0 + 1e-9
