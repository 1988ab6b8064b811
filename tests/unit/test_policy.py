"""The serving policy as a pure table: what follows an attempt."""

from __future__ import annotations

import pytest

from narwhal.dataplane.policy import (
    Limits,
    Next,
    Outcome,
    StepAside,
    after_attempt,
    limits_for,
    may_continue,
    step_aside,
)

BOUNDED = limits_for("bounded", max_attempts=3, migrations=2)
SINGLE = limits_for("single_attempt", max_attempts=3, migrations=2)


def test_single_attempt_allows_one() -> None:
    assert Limits(attempts=1, migrations=2) == SINGLE
    assert Limits(attempts=3, migrations=2) == BOUNDED


@pytest.mark.parametrize(
    ("outcome", "number", "limits", "now", "expected"),
    [
        (Outcome.SERVED, 0, BOUNDED, 0.0, Next.ANSWER),
        (Outcome.SETTLED, 0, BOUNDED, 0.0, Next.ANSWER),
        (Outcome.RETRYABLE, 0, BOUNDED, 0.0, Next.RETRY),
        (Outcome.RETRYABLE, 1, BOUNDED, 0.0, Next.RETRY),
        (Outcome.RETRYABLE, 2, BOUNDED, 0.0, Next.GIVE_UP),  # attempts used up
        (Outcome.RETRYABLE, 0, BOUNDED, 10.0, Next.GIVE_UP),  # the deadline passed
        (Outcome.RETRYABLE, 0, SINGLE, 0.0, Next.GIVE_UP),
        (Outcome.FAILED_STARTED, 0, BOUNDED, 0.0, Next.GIVE_UP),  # the client has bytes
        (Outcome.INTERRUPTED, 0, BOUNDED, 0.0, Next.MIGRATE),
        (Outcome.INTERRUPTED, 0, SINGLE, 0.0, Next.MIGRATE),  # migration is not a retry
    ],
)
def test_after_an_attempt(
    outcome: Outcome, number: int, limits: Limits, now: float, expected: Next
) -> None:
    assert after_attempt(outcome, number, limits, now, deadline=10.0) is expected


@pytest.mark.parametrize(
    ("migrations", "now", "expected"),
    [(0, 0.0, True), (1, 9.9, True), (2, 0.0, False), (0, 10.0, False)],
)
def test_a_broken_stream_is_continued_within_its_limit_and_deadline(
    migrations: int, now: float, expected: bool
) -> None:
    assert may_continue(migrations, BOUNDED, now, deadline=10.0) is expected


def test_a_stream_steps_aside_only_mid_generation_with_a_migration_left() -> None:
    limits = Limits(attempts=1, migrations=2)
    assert step_aside(True, 1, True, limits) is StepAside.NOW
    assert step_aside(False, 0, True, limits) is StepAside.NOT_YET  # no first byte yet
    assert step_aside(True, 2, True, limits) is StepAside.NEVER  # out of migrations
    assert step_aside(False, 2, True, limits) is StepAside.NEVER
    assert step_aside(True, 0, False, limits) is StepAside.NEVER  # its finish_reason went out
