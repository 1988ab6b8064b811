"""What follows an attempt: the serving policy as a pure function, in the style of
`fleet/reducer.py`.

`single_attempt` gives each request one attempt; `bounded` up to `serving.max_attempts`
within the request's deadline, on engines not yet tried first. A stream that already sent the
client a byte is never retried from scratch: it is continued (migrated) when it may be, up to
`serving.migrations` times within the deadline (DESIGN §1), else ended with an error event.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Next(Enum):
    RETRY = "retry"  # another attempt, from scratch, on another engine if one is left
    MIGRATE = "migrate"  # continue the client's stream on a fresh pair
    ANSWER = "answer"  # the outcome is the client's answer (a success, a 4xx, no capacity)
    GIVE_UP = "give_up"  # answer with the last failure


class Outcome(Enum):
    """An attempt's end, as the policy sees it."""

    SERVED = "served"
    SETTLED = "settled"  # ends the request whatever the policy (4xx, no capacity, deadline)
    RETRYABLE = "retryable"  # failed before the client's first byte: another engine may serve
    INTERRUPTED = "interrupted"  # failed after the client's first byte, and may be continued
    FAILED_STARTED = "failed_started"  # failed after the client's first byte, not continuable


@dataclass(frozen=True, slots=True)
class Limits:
    attempts: int  # 1 under single_attempt
    migrations: int


def limits_for(policy: str, max_attempts: int, migrations: int) -> Limits:
    return Limits(max_attempts if policy == "bounded" else 1, migrations)


def after_attempt(
    outcome: Outcome, number: int, limits: Limits, now: float, deadline: float
) -> Next:
    """`number` counts attempts from 0."""
    if outcome is Outcome.INTERRUPTED:
        return Next.MIGRATE
    if outcome in (Outcome.SERVED, Outcome.SETTLED):
        return Next.ANSWER
    if outcome is Outcome.RETRYABLE and number + 1 < limits.attempts and now < deadline:
        return Next.RETRY
    return Next.GIVE_UP


def may_continue(migrations: int, limits: Limits, now: float, deadline: float) -> bool:
    """Whether a broken stream gets another continuation."""
    return migrations < limits.migrations and now < deadline


class StepAside(Enum):
    """A running stream's answer to flow control's `Preempt`."""

    NOW = "now"  # cut off its engine: it goes on when the queue grants it again
    NOT_YET = "not_yet"  # not reading its answer yet: between legs, or before its first byte
    NEVER = "never"  # out of migrations, its generation delivered, or not migratable


def step_aside(started: bool, migrations: int, generating: bool, limits: Limits) -> StepAside:
    """Whether a stream may be preempted (flow control's `Preempt`): now if it began (the
    client has its first byte, so it goes on by migration), a migration is left, and it is
    still `generating` (a stream whose finish_reason or `[DONE]` was delivered has nothing
    left to give a slot back for); not yet if only its first byte is missing."""
    if not generating or migrations >= limits.migrations:
        return StepAside.NEVER
    return StepAside.NOW if started else StepAside.NOT_YET
