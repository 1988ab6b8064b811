"""Readmission backoff (DESIGN §2: ejected engines are retried with backoff; §8: randomness is
injected): exponential growth from the base, a cap, and jitter in the upper half of the delay,
with a fixed random source standing in for the real one.
"""

from __future__ import annotations

import random

import pytest

from narwhal.control.readmission import backoff_s


class FixedRandom(random.Random):
    """A random source that always draws `value` from [0, 1)."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


LOW, MID, HIGH = 0.0, 0.5, 0.999999


@pytest.mark.parametrize(
    ("attempt", "base_s", "cap_s", "draw", "expected_s"),
    [
        # growth: the delay doubles with each failed attempt; the lowest draw waits half of it
        (1, 1.0, 30.0, LOW, 0.5),
        (2, 1.0, 30.0, LOW, 1.0),
        (3, 1.0, 30.0, LOW, 2.0),
        (4, 1.0, 30.0, LOW, 4.0),
        (5, 1.0, 30.0, LOW, 8.0),
        # jitter: the draw places the wait in [delay/2, delay]
        (3, 1.0, 30.0, MID, 3.0),
        (3, 1.0, 30.0, HIGH, 4.0),
        (1, 0.2, 6.0, MID, 0.15),
        # the cap bounds the delay, jitter included
        (6, 1.0, 30.0, LOW, 15.0),
        (6, 1.0, 30.0, HIGH, 30.0),
        (7, 1.0, 30.0, MID, 22.5),
        (100, 1.0, 30.0, HIGH, 30.0),
        # an engine that stays out for days: the exponent never overflows a float
        (5000, 1.0, 30.0, LOW, 15.0),
        (10**9, 0.1, 3.0, HIGH, 3.0),
        # attempt 0 (nothing failed yet) waits like the first
        (0, 1.0, 30.0, LOW, 0.5),
    ],
)
def test_backoff_table(
    attempt: int, base_s: float, cap_s: float, draw: float, expected_s: float
) -> None:
    assert backoff_s(attempt, base_s, cap_s, FixedRandom(draw)) == pytest.approx(
        expected_s, abs=1e-4
    )


@pytest.mark.parametrize("attempt", [1, 2, 3, 5, 6, 12, 400])
def test_jitter_stays_within_half_the_delay_and_the_delay(attempt: int) -> None:
    delay = min(30.0, 2.0 ** (min(attempt, 64) - 1))
    rng = random.Random(1234)
    waits = [backoff_s(attempt, 1.0, 30.0, rng) for _ in range(500)]
    assert all(delay / 2 <= w <= delay for w in waits)
    assert max(waits) - min(waits) > delay / 4  # it does spread (jitter, not a constant)


def test_the_same_seed_gives_the_same_schedule() -> None:
    first = [backoff_s(n, 1.0, 30.0, random.Random(7)) for n in range(1, 10)]
    again = [backoff_s(n, 1.0, 30.0, random.Random(7)) for n in range(1, 10)]
    assert first == again
