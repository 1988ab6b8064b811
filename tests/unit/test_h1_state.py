"""The HTTP/1.1 connection's state machine (`process/h1_state.py`), table-driven: each case
is a sequence of events with the moment they happen, and the states, refusal and deadline
that must follow. No sockets, no loop: time is the `now` each call is given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from narwhal.process.h1_state import (
    IN_TABLE,
    OUT_TABLE,
    After,
    Connection,
    Event,
    In,
    Limits,
    Out,
    ProtocolError,
    Refusal,
)

LIMITS = Limits(
    max_head_bytes=100,
    max_body_bytes=1000,
    header_timeout_s=10.0,
    body_timeout_s=30.0,
    keepalive_s=75.0,
    linger_s=5.0,
)

Step = Callable[[Connection], object]


def data(n: int, t: float) -> Step:
    return lambda c: c.data(n, t)


def parsed(t: float) -> Step:
    return lambda c: c.parsed(t)


def begin(t: float) -> Step:
    return lambda c: c.begin(t)


def header(n: int, t: float) -> Step:
    return lambda c: c.header(n, t)


def head(length: int | None, t: float, expects: bool = False) -> Step:
    return lambda c: c.head(length, expects, t)


def body(n: int, t: float) -> Step:
    return lambda c: c.body(n, t)


def end(t: float) -> Step:
    return lambda c: c.end(t)


def start() -> Step:
    return lambda c: c.start()


def want(t: float) -> Step:
    return lambda c: c.want_body(t)


def pause(on: bool, t: float) -> Step:
    return lambda c: c.pause(on, t)


def answered(complete: bool, keep: bool, t: float) -> Step:
    return lambda c: c.answered(complete, keep, t)


def expire(t: float) -> Step:
    return lambda c: c.expire(t)


def request(t: float, length: int | None = None, expects: bool = False) -> list[Step]:
    """A whole head arriving at `t` and its handler starting."""
    return [data(40, t), begin(t), header(40, t), head(length, t, expects), start()]


@dataclass(frozen=True)
class Case:
    name: str
    steps: list[Step]
    inbound: In
    outbound: Out
    result: object  # what the last step returned
    deadline: float | None


CASES = [
    Case("a new connection waits for its head from the accept", [], In.HEAD, Out.IDLE, None, 10.0),
    Case(
        "a connection never used closes silently at the head's deadline",
        [expire(10.0)],
        In.CLOSED,
        Out.CLOSED,
        None,
        None,
    ),
    Case(
        "the timer firing early changes nothing",
        [data(5, 1.0), expire(9.9)],
        In.HEAD,
        Out.IDLE,
        None,
        10.0,
    ),
    Case(
        "a head not whole in header_timeout_s: 408 (from the accept, not the first byte)",
        [data(5, 9.0), parsed(9.0), expire(10.0)],
        In.DISCARD,
        Out.CLOSED,
        Refusal(408, "header_timeout", "request head not received in time"),
        12.0,  # dropping what follows for REFUSAL_LINGER_S, then the close
    ),
    Case(
        "a head still growing past max_head_bytes: 431 on its raw size",
        [data(101, 1.0), parsed(1.0)],
        In.DISCARD,
        Out.CLOSED,
        Refusal(431, "header_too_large", "request head too large"),
        3.0,
    ),
    Case(
        "a whole head over max_head_bytes: 431 as the parser hands it over",
        [data(50, 1.0), begin(1.0), header(60, 1.0), header(60, 1.0)],
        In.DISCARD,
        Out.CLOSED,
        Refusal(431, "header_too_large", "request head too large"),
        3.0,
    ),
    Case(
        "a declared body over max_body_bytes: 413 at the head, before any handler",
        [data(40, 1.0), begin(1.0), head(1001, 1.0)],
        In.DISCARD,
        Out.CLOSED,
        Refusal(413, "body_too_large", "request body exceeds 1000 bytes"),
        3.0,
    ),
    Case(
        "a declared body at the bound is taken",
        [*request(1.0, 1000), body(1000, 2.0)],
        In.BODY,
        Out.HANDLER,
        None,
        32.0,
    ),
    Case(
        "a chunked body past max_body_bytes: 413 while the handler runs (it answers)",
        [*request(1.0), body(600, 2.0), body(401, 3.0)],
        In.DISCARD,
        Out.HANDLER,
        Refusal(413, "body_too_large", "request body exceeds 1000 bytes"),
        None,  # the handler answers first; the linger starts after
    ),
    Case(
        "the body's clock restarts at every read",
        [*request(1.0), body(10, 20.0), body(10, 40.0)],
        In.BODY,
        Out.HANDLER,
        None,
        70.0,
    ),
    Case(
        "a body trickled slower than body_timeout_s: 408",
        [*request(1.0), body(10, 20.0), expire(50.0)],
        In.DISCARD,
        Out.HANDLER,
        Refusal(408, "body_timeout", "request body not received in time"),
        None,
    ),
    Case(
        "no body clock while the server paused reading",
        [*request(1.0), body(10, 2.0), pause(True, 3.0)],
        In.BODY,
        Out.HANDLER,
        None,
        None,
    ),
    Case(
        "resuming restarts the body clock",
        [*request(1.0), body(10, 2.0), pause(True, 3.0), pause(False, 100.0)],
        In.BODY,
        Out.HANDLER,
        None,
        130.0,
    ),
    Case(
        "Expect: 100-continue: no body clock before the handler asks for the body",
        request(1.0, 10, expects=True),
        In.BODY,
        Out.HANDLER,
        None,
        None,
    ),
    Case(
        "the handler asks: 100 Continue now, and the body clock starts",
        [*request(1.0, 10, expects=True), want(4.0)],
        In.BODY,
        Out.HANDLER,
        True,
        34.0,
    ),
    Case(
        "100 Continue goes out once",
        [*request(1.0, 10, expects=True), want(4.0), want(5.0)],
        In.BODY,
        Out.HANDLER,
        False,
        34.0,
    ),
    Case(
        "no 100 Continue without the client asking",
        [*request(1.0, 10), want(4.0)],
        In.BODY,
        Out.HANDLER,
        False,
        31.0,
    ),
    Case(
        "answered without asking for the body (a 401): close, the client never sends it",
        [*request(1.0, 10, expects=True), answered(False, True, 2.0)],
        In.CLOSED,
        Out.CLOSED,
        After.CLOSE,
        None,
    ),
    Case(
        "a whole request answered, keep-alive: idle until keepalive_s",
        [*request(1.0), end(1.0), answered(True, True, 2.0)],
        In.IDLE,
        Out.IDLE,
        After.KEEP,
        77.0,
    ),
    Case(
        "an idle connection closes at keepalive_s, with no answer",
        [*request(1.0), end(1.0), answered(True, True, 2.0), expire(77.0)],
        In.CLOSED,
        Out.CLOSED,
        None,
        None,
    ),
    Case(
        "the next request's first byte starts its head clock",
        [*request(1.0), end(1.0), answered(True, True, 2.0), data(5, 50.0)],
        In.HEAD,
        Out.IDLE,
        None,
        60.0,
    ),
    Case(
        "the head said close: close after the answer",
        [*request(1.0), end(1.0), answered(True, False, 2.0)],
        In.CLOSED,
        Out.CLOSED,
        After.CLOSE,
        None,
    ),
    Case(
        "answered while the body arrives: the rest is dropped for linger_s",
        [*request(1.0, 500), body(10, 1.5), answered(False, True, 2.0)],
        In.DISCARD,
        Out.IDLE,
        After.DISCARD,
        7.0,
    ),
    Case(
        "dropped bytes past max_body_bytes: reading stops (discard_full), the linger goes on",
        [*request(1.0, 500), answered(False, True, 2.0), data(1001, 3.0)],
        In.DISCARD,
        Out.IDLE,
        None,
        7.0,
    ),
    Case(
        "dropped bytes past max_body_bytes: the linger's end closes",
        [*request(1.0, 500), answered(False, True, 2.0), data(1001, 3.0), expire(7.0)],
        In.CLOSED,
        Out.CLOSED,
        None,
        None,
    ),
    Case(
        "a refused body's handler answered: the linger goes on, then the close",
        [*request(1.0), body(1001, 2.0), answered(False, True, 2.5), expire(4.5)],
        In.CLOSED,
        Out.CLOSED,
        None,
        None,
    ),
    Case(
        "a refused body's handler still answering: what arrives is not held against it",
        [*request(1.0), body(1001, 2.0), data(5000, 2.1), lambda c: c.answer_pending],
        In.DISCARD,
        Out.HANDLER,
        True,  # the shell stops reading until the answer is out
        None,
    ),
    Case(
        "the linger after a refusal starts with its answer, however late",
        [*request(1.0), body(1001, 2.0), data(5000, 8.0), answered(False, True, 9.0)],
        In.DISCARD,
        Out.IDLE,
        After.DISCARD,
        11.0,
    ),
    Case(
        "pipelined: the next head may arrive while a handler runs; its clock runs",
        [*request(1.0), end(1.0), begin(2.0)],
        In.HEAD,
        Out.HANDLER,
        None,
        12.0,
    ),
    Case(
        "a stream's head out: streaming until answered",
        [*request(1.0), end(1.0), lambda c: c.stream()],
        In.IDLE,
        Out.STREAMING,
        None,
        None,
    ),
    Case(
        "the client leaves: closed both ways",
        [*request(1.0), lambda c: c.lost()],
        In.CLOSED,
        Out.CLOSED,
        None,
        None,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_connection_follows_its_tables(case: Case) -> None:
    c = Connection(LIMITS, 0.0)
    result: object = None
    for step in case.steps:
        result = step(c)
        # the flags the shell reads stay what the inbound state says, after every step
        assert c.closed == (c.inbound is In.CLOSED)
        assert c.discarding == (c.inbound is In.DISCARD)
        assert c.closing == (c.inbound in (In.CLOSED, In.DISCARD))
    assert (c.inbound, c.outbound) == (case.inbound, case.outbound)
    assert result == case.result
    assert c.deadline() == case.deadline


@pytest.mark.parametrize(
    "steps",
    [
        [lambda c: c.stream()],  # a stream with no handler
        [lambda c: c.answered(True, True, 1.0)],  # an answer with no handler
        [*request(1.0), start()],  # two handlers at once
        [data(5, 1.0), end(1.0)],  # a request's end before its head
    ],
    ids=["stream-without-handler", "answer-without-handler", "two-handlers", "end-before-head"],
)
def test_an_event_the_tables_do_not_allow_is_the_shells_bug(steps: list[Step]) -> None:
    c = Connection(LIMITS, 0.0)
    with pytest.raises(ProtocolError):
        for step in steps:
            step(c)


def test_refusing_lost_and_closing_are_allowed_in_every_state() -> None:
    for table, states in ((IN_TABLE, In), (OUT_TABLE, Out)):
        for state in states:
            for event in (Event.REFUSE, Event.CLOSE, Event.LOST):
                assert (state, event) in table, (state, event)


def test_the_drop_allowance_used_up_says_stop_reading_instead_of_closing() -> None:
    """Closing on a client still sending would reset the connection, and the reset can
    destroy the answer in the client's receive buffer before it reads it: the shell stops
    reading instead (`discard_full`), and the linger's end closes."""
    c = Connection(LIMITS, 0.0)
    for step in [*request(1.0, 500), answered(False, True, 2.0), data(1000, 3.0)]:
        step(c)
    assert not c.discard_full
    c.data(1, 3.5)
    assert c.discard_full and not c.closed


def test_closed_is_final() -> None:
    assert {after for (before, _), after in IN_TABLE.items() if before is In.CLOSED} == {In.CLOSED}
    assert {after for (before, _), after in OUT_TABLE.items() if before is Out.CLOSED} == {
        Out.CLOSED
    }
