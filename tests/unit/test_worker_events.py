"""Workers' typed events: one codec, every event back as it was sent, bad frames refused."""

from __future__ import annotations

import orjson
import pytest

from narwhal.engine.failures import FailureClass, SuccessKind
from narwhal.flow.messages import Ask, Begun, Done, Kept, Preempt, Refuse, Requeue, Start, Withdraw
from narwhal.process.events import (
    FrameError,
    LegFailed,
    LegSucceeded,
    Noted,
    Placed,
    Ready,
    Seen,
    Stats,
    WorkerEvent,
    decode,
    decode_answer,
    encode,
    encode_answer,
)

EVENTS: list[WorkerEvent] = [
    LegFailed(3, "d0", "decode", FailureClass.STREAM, "mid-stream silence", None, True),
    LegFailed(4, "p0", "prefill", FailureClass.OVERLOAD, "HTTP 503", 503, False),
    LegSucceeded(5, "p0", "prefill", SuccessKind.PREFILL_HANDOFF),
    Noted("migration", "d1", "stream r-1 continued after 5 tokens"),
    Noted("migration", None, "no engine"),
    Placed("m", "p1", (1, 2**64 - 1)),
    Seen(12),
    Ready(4242),
    Stats({"p0": [3, [0.1], [0.01]]}, (3, 0, 0.2)),
    Ask("r1", "m", "c", None, 2, 10, 20, 5.0, True, 0, True),
    Begun("r1", "decode", "d0"),
    Done("r1", 8, 10),
    Withdraw("r1"),
    Requeue("r1"),
    Kept("r1"),
    Kept("r1", for_now=True),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_comes_back_as_it_was_sent(event: WorkerEvent) -> None:
    kind, fields = encode(event)
    wire = orjson.loads(orjson.dumps({**fields, "t": kind}))
    assert decode(wire) == event


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        ({"t": "ev", "seq": 1}, "unknown frame kind 'ev'"),
        ({"seq": 1}, "unknown frame kind None"),
        ({"t": "failed", "seq": 1, "engine": "d0"}, "failed frame without 'leg'"),
        (
            {"t": "failed", "seq": 1, "engine": "d0", "leg": "decode", "failure_class": "nope",
             "detail": "x", "status": None, "timed_out": False},
            "failed frame: 'nope' is not a valid FailureClass",
        ),
        ({"t": "placed", "model": "m", "engine": "p0", "keys": ["x"]}, "placed frame"),
    ],
)  # fmt: skip
def test_a_frame_that_is_no_whole_event_is_refused_with_the_reason(
    frame: dict[str, object], says: str
) -> None:
    with pytest.raises(FrameError, match="^" + says.replace("(", r"\(")):
        decode(frame)


@pytest.mark.parametrize(
    "answer",
    [
        Start("r1", 1, 0, 0.0, {"x-ratelimit-limit-requests": "10"}),
        Refuse("r1", 1, 429, "queue_full", "full", 2, {}, 3),
        Preempt("r1", 1, 2),
    ],
    ids=lambda e: type(e).__name__,
)
def test_flow_control_s_answers_reach_the_worker_whole(answer: Start | Refuse | Preempt) -> None:
    kind, fields = encode_answer(answer)
    wire = orjson.loads(orjson.dumps({**fields, "t": kind}))
    got = decode_answer(wire, 1)
    assert (type(got), got.id, got.worker) == (type(answer), "r1", 1)
    if not isinstance(answer, Start):
        assert got.priority == answer.priority
