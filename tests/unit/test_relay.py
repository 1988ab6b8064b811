"""The stream relay's state machine, table-driven: engine bytes in, client bytes and an ending
out, no I/O."""

from __future__ import annotations

import pytest

from narwhal.dataplane.migration import Splice
from narwhal.dataplane.relay import TRANSITIONS, Failure, IllegalTransition, Phase, Relay

EVENT = b'data: {"choices":[{"text":"a"}]}\n\n'
DONE = b"data: [DONE]\n\n"
ERROR = b'data: {"error":{"message":"boom"}}\n\n'


def relay_all(chunks: list[bytes], splice: Splice | None = None) -> tuple[Relay, bytes]:
    """Feed `chunks` then the body's end the way the streaming leg does; what the client got."""
    relay = Relay(splice)
    sent = b""
    for chunk in [*chunks, b""]:
        out = relay.feed(chunk)
        if relay.phase is Phase.FAILED:
            return relay, sent
        if out:
            relay.sent()
            sent += out
        if relay.settle() or not chunk:
            break
    if relay.phase is not Phase.FAILED:
        relay.ended()
    return relay, sent


@pytest.mark.parametrize(
    ("chunks", "phase", "failure", "sent"),
    [
        ([EVENT, DONE], Phase.DONE, None, EVENT + DONE),
        ([EVENT + DONE], Phase.DONE, None, EVENT + DONE),
        ([EVENT, b"data: [DONE]\n"], Phase.DONE, None, EVENT + b"data: [DONE]\n\n"),
        ([EVENT], Phase.FAILED, Failure.NO_DONE, EVENT),
        ([EVENT, b"data: not json\n\n"], Phase.FAILED, Failure.MALFORMED, EVENT),
        ([EVENT, ERROR, DONE], Phase.FAILED, Failure.ERROR_EVENT, EVENT + ERROR + DONE),
        ([DONE], Phase.DONE, None, DONE),
        ([], Phase.FAILED, Failure.NO_DONE, b""),
    ],
)
def test_a_stream_ends_as_its_bytes_say(
    chunks: list[bytes], phase: Phase, failure: Failure | None, sent: bytes
) -> None:
    relay, got = relay_all(chunks)
    assert (relay.phase, relay.failure, got) == (phase, failure, sent)


def test_the_first_bytes_sent_start_the_stream_once() -> None:
    relay = Relay(None)
    assert relay.feed(EVENT) == EVENT
    assert relay.sent() is True
    assert relay.started
    assert relay.feed(EVENT) == EVENT
    assert relay.sent() is False


@pytest.mark.parametrize(
    ("started", "writing", "at_deadline", "phase", "failure"),
    [
        (False, False, False, Phase.FAILED, Failure.FIRST_TOKEN),
        (True, False, False, Phase.FAILED, Failure.SILENCE),
        (True, False, True, Phase.DEADLINE, None),
        (False, False, True, Phase.FAILED, Failure.FIRST_TOKEN),  # the engine never answered
        (True, True, False, Phase.DEADLINE, None),  # the client stopped reading
        (True, True, True, Phase.DEADLINE, None),
    ],
)
def test_a_timer_is_the_engine_s_fault_unless_the_client_or_the_deadline_ran_out(
    started: bool, writing: bool, at_deadline: bool, phase: Phase, failure: Failure | None
) -> None:
    relay = Relay(None)
    if started:
        relay.feed(EVENT)
        relay.sent()
    relay.timed_out(writing, at_deadline)
    assert (relay.phase, relay.failure, relay.write_timed_out) == (phase, failure, writing)
    assert relay.failure is None or relay.failure.timed_out


def test_complete_only_when_done_reached_the_client() -> None:
    relay = Relay(None)
    relay.feed(EVENT + DONE)
    relay.sent()
    assert relay.complete
    relay.client_gone()  # the write of those bytes failed
    assert not relay.complete


def test_a_splice_rewrites_events_and_a_broken_one_fails_after_the_good_ones() -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 4}
    splice = Splice("completions", body, include_usage=False)
    relay = Relay(splice)
    out = relay.feed(b'data: {"id":"x","created":1,"model":"m","choices":[{"index":0,"text":"a",'
                     b'"token_ids":[5]}],"prompt_token_ids":[1,2]}\n\n')  # fmt: skip
    assert out.startswith(b"data: ")
    assert not relay.settle()
    relay.sent()
    relay.feed(b"data: nonsense\n\n")
    assert relay.settle() is True
    assert (relay.phase, relay.failure) == (Phase.FAILED, Failure.MALFORMED)


def test_terminal_phases_are_final_and_every_phase_is_in_the_table() -> None:
    assert set(TRANSITIONS) == set(Phase)
    relay = Relay(None)
    relay.moved()
    assert relay.phase is Phase.MOVED
    with pytest.raises(IllegalTransition, match="moved -> client_gone"):
        relay.client_gone()
    for phase in (Phase.DONE, Phase.FAILED, Phase.CLIENT_GONE, Phase.MOVED, Phase.DEADLINE):
        assert TRANSITIONS[phase] == frozenset()
