"""The SSE scanner (DESIGN §1, "Streams"): `[DONE]` at any chunking, malformed events, comments."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.dataplane.sse import SseScanner

DONE = b"data: [DONE]\n\n"


def _event(i: int, text: str = "tok") -> bytes:
    return (
        b"data: "
        + orjson.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": f"{text}{i}"}]})
        + b"\n\n"
    )


def _crlf(data: bytes) -> bytes:
    return data.replace(b"\n", b"\r\n")


def _scan(*chunks: bytes) -> SseScanner:
    scanner = SseScanner()
    for chunk in chunks:
        scanner.feed(chunk)
    return scanner


# (id, chunks, done, malformed, events)
CASES: list[tuple[str, list[bytes], bool, bool, int]] = [
    ("empty", [], False, False, 0),
    ("done-only", [DONE], True, False, 0),
    ("events-then-done", [_event(0), _event(1), DONE], True, False, 2),
    ("one-chunk", [_event(0) + _event(1) + DONE], True, False, 2),
    ("no-done", [_event(0), _event(1)], False, False, 2),
    ("done-without-blank-line", [_event(0), b"data: [DONE]\n"], False, False, 1),
    ("done-without-newline", [_event(0), b"data: [DONE]"], False, False, 1),
    ("comment", [b": keep-alive\n\n", _event(0), DONE], True, False, 1),
    ("comment-no-space", [b":ping\n\n", DONE], True, False, 0),
    ("blank-event", [b"\n\n", _event(0), DONE], True, False, 1),
    ("event-incomplete-at-end", [_event(0), b'data: {"x": 1}'], False, False, 1),
    ("split-inside-terminator", [b"data: [DONE]\n", b"\n"], True, False, 0),
    ("split-byte-by-byte", [bytes([b]) for b in _event(0) + DONE], True, False, 1),
    ("split-inside-payload", [_event(0)[:9], _event(0)[9:], DONE[:4], DONE[4:]], True, False, 1),
    ("utf8-split-mid-codepoint", [_event(0, "é")[:40], _event(0, "é")[40:], DONE], True, False, 1),
    ("malformed-not-json", [b"data: hello\n\n", DONE], True, True, 0),
    ("malformed-unclosed-object", [b'data: {"a": 1\n\n', DONE], True, True, 0),
    ("malformed-unknown-field", [b"foo: bar\n\n", DONE], True, True, 0),
    ("malformed-field-without-colon", [b"hello\n\n", DONE], True, True, 0),
    ("malformed-array", [b"data: [1, 2]\n\n", DONE], True, True, 0),
    ("malformed-done-variant", [b"data: [done]\n\n"], False, True, 0),
    ("malformed-garbage", [b"\x00\xff\n\n"], False, True, 0),
    ("malformed-before-done-split", [b"da", b"ta: oops\n", b"\n", DONE], True, True, 0),
    ("nothing-counted-after-done", [DONE, _event(0), b"garbage\n\n"], True, False, 0),
    # The SSE format as other engines write it (not only as vLLM and the sim do).
    ("crlf", [_crlf(_event(0)), _crlf(DONE)], True, False, 1),
    (
        "crlf-split-inside-separator",
        [_crlf(_event(0))[:-1], b"\n", b"data: [DONE]\r", b"\n\r\n"],
        True,
        False,
        1,
    ),
    ("cr-only", [_event(0).replace(b"\n", b"\r"), b"data: [DONE]\r\r"], True, False, 1),
    ("cr-split-at-end", [b"data: [DONE]\r", b"\r"], True, False, 0),
    ("data-without-space", [b'data:{"a": 1}\n\n', b"data:[DONE]\n\n"], True, False, 1),
    ("trailing-whitespace", [b'data: {"a": 1}  \n\n', b"data: [DONE] \t\n\n"], True, False, 1),
    (
        "id-event-retry-ignored",
        [b'id: 7\nevent: message\ndata: {"a": 1}\n\n', b"retry: 100\n\n", b"event: x\n\n", DONE],
        True,
        False,
        1,
    ),
    ("field-without-value", [b'id\ndata: {"a": 1}\n\n', DONE], True, False, 1),
    ("comment-line-inside-event", [b': ping\ndata: {"a": 1}\n\n', DONE], True, False, 1),
    ("multi-line-data", [b'data: {"a":\ndata: 1}\n\n', DONE], True, False, 1),
    ("empty-data-dispatches-nothing", [b"data:\n\n", DONE], True, False, 0),
    ("malformed-after-event-field", [b"event: x\ndata: hello\n\n", DONE], True, True, 0),
]


@pytest.mark.parametrize(
    ("chunks", "done", "malformed", "events"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_scanner(chunks: list[bytes], done: bool, malformed: bool, events: int) -> None:
    scanner = _scan(*chunks)
    assert (scanner.done, scanner.malformed, scanner.events) == (done, malformed, events)


def test_malformed_is_sticky() -> None:
    scanner = _scan(b"data: nope\n\n")
    assert scanner.malformed
    scanner.feed(_event(0) + DONE)
    assert scanner.malformed


def test_done_is_not_reported_before_its_terminator_arrives() -> None:
    scanner = _scan(_event(0), b"data: [DONE]")
    assert not scanner.done
    scanner.feed(b"\n")
    assert not scanner.done
    scanner.feed(b"\n")
    assert scanner.done


ERROR = b'data: {"error": {"message": "engine failed", "type": "internal", "code": 500}}\n\n'


@pytest.mark.parametrize(
    "chunks",
    [
        [_event(0), ERROR, DONE],
        [_event(0) + ERROR[:12], ERROR[12:] + DONE],
        [_crlf(_event(0)), _crlf(ERROR.replace(b"data: ", b"data:")), _crlf(DONE)],
        [ERROR.replace(b"data: ", b"event: error\ndata: "), DONE],
    ],
    ids=["lf", "split", "crlf-no-space", "with-event-field"],
)
def test_an_in_band_error_event_is_reported_not_counted(chunks: list[bytes]) -> None:
    scanner = _scan(*chunks)
    assert scanner.error is not None and b'{"error"' in scanner.error
    assert (scanner.done, scanner.malformed) == (True, False)
    assert scanner.last is None or b'"error"' not in scanner.last


def test_a_field_named_error_inside_a_chunk_is_not_an_error_event() -> None:
    scanner = _scan(b'data: {"choices": [{"text": "error"}], "error": null}\n\n', DONE)
    assert scanner.error is None
    assert scanner.events == 1


def test_the_first_error_event_is_kept() -> None:
    scanner = _scan(ERROR, ERROR.replace(b"engine failed", b"second"), DONE)
    assert scanner.error is not None and b"engine failed" in scanner.error


def test_odd_blank_line_between_events_is_not_malformed() -> None:
    """Regression: '\\n\\n\\n' used to glue a '\\n' onto the next event (malformed, no DONE)."""
    scanner = _scan(_event(0) + b"\n" + _event(1) + b"\n" + DONE)
    assert (scanner.done, scanner.malformed, scanner.events) == (True, False, 2)


def test_even_blank_lines_between_events_are_tolerated() -> None:
    scanner = _scan(_event(0) + b"\n\n" + _event(1) + DONE)
    assert (scanner.done, scanner.malformed, scanner.events) == (True, False, 2)


# --------------------------------------------------------------------------- properties

_texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
_good_event = st.one_of(
    _texts.map(lambda t: b"data: " + orjson.dumps({"choices": [{"text": t}]}) + b"\n\n"),
    _texts.filter(lambda t: "\n" not in t and "\r" not in t).map(
        lambda t: b":" + t.encode() + b"\n\n"
    ),
)
_blank = st.sampled_from([b"\n", b"\n\n"])  # blank lines between events are legal SSE
_bad_event = st.sampled_from(
    [b"data: oops\n\n", b"evnt: x\n\n", b'data: {"a"\n\n', b"retry 10\n\n", b"data: [1]\n\n"]
)


def _split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    edges = [0, *points, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=80, deadline=None)
@given(st.lists(_good_event | _blank, max_size=6), st.lists(st.integers(0, 10_000), max_size=12))
def test_valid_stream_split_anywhere_is_done(events: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(events) + DONE
    scanner = _scan(*_split(stream, cuts))
    assert scanner.done
    assert not scanner.malformed
    assert scanner.events == sum(e.startswith(b"data: ") for e in events)
    assert scanner.events == stream.count(b"data: {")


@settings(max_examples=80, deadline=None)
@given(
    st.lists(_good_event, max_size=6),
    st.integers(0, 10_000),
    st.lists(st.integers(0, 10_000), max_size=12),
)
def test_truncated_stream_is_not_done(events: list[bytes], cut: int, cuts: list[int]) -> None:
    stream = b"".join(events) + DONE
    truncated = stream[: cut % len(stream)]  # anything short of the full terminator
    scanner = _scan(*_split(truncated, cuts))
    assert not scanner.done
    assert not scanner.malformed


@settings(max_examples=80, deadline=None)
@given(
    st.lists(_good_event, max_size=4),
    _bad_event,
    st.lists(_good_event, max_size=4),
    st.lists(st.integers(0, 10_000), max_size=12),
)
def test_stream_with_a_malformed_event_is_malformed(
    before: list[bytes], bad: bytes, after: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(before) + bad + b"".join(after) + DONE
    scanner = _scan(*_split(stream, cuts))
    assert scanner.malformed


@settings(max_examples=80, deadline=None)
@given(
    st.lists(_good_event | _blank, max_size=6),
    st.lists(st.integers(0, 10_000), max_size=12),
    st.sampled_from([b"\r\n", b"\r"]),
)
def test_valid_stream_with_other_line_endings_split_anywhere_is_done(
    events: list[bytes], cuts: list[int], ending: bytes
) -> None:
    stream = (b"".join(events) + DONE).replace(b"\n", ending)
    scanner = _scan(*_split(stream, cuts))
    assert scanner.done
    assert not scanner.malformed
    assert scanner.events == stream.count(b"data: {")


# ------------------------------------------------------------ [DONE] line at EOF, no blank line
@pytest.mark.parametrize(
    ("tail", "ending"),
    [
        (b"data: [DONE]\n", b"\n"),
        (b"data: [DONE]\r\n", b"\n"),
        (b"data: [DONE]", b"\n\n"),
        (b"data:[DONE]\n", b"\n"),
        (b"\ndata: [DONE] \n", b"\n"),
    ],
)
def test_a_done_line_left_at_eof_ends_the_stream(tail: bytes, ending: bytes) -> None:
    scanner = _scan(_event(0), tail)
    assert not scanner.done  # not dispatched yet: the blank line is missing
    assert scanner.end() == ending
    assert scanner.done and not scanner.malformed and scanner.events == 1
    # The bytes returned complete the event: a fresh scan of everything finds [DONE].
    assert _scan(_event(0), tail, ending).done


def test_a_done_line_split_across_chunks_at_eof_ends_the_stream() -> None:
    scanner = _scan(_event(0), b"data: [DO", b"NE]\r", b"\n")
    assert scanner.end() == b"\n" and scanner.done


@pytest.mark.parametrize(
    "tail",
    [
        b"",
        b"data: [DONE]x\n",
        b"data: [DON",
        b"data: {}\ndata: [DONE]\n",
        b'data: {"id": "x"}\n',
        b"event: done\n",
    ],
)
def test_anything_else_left_at_eof_is_not_done(tail: bytes) -> None:
    scanner = _scan(_event(0), tail)
    assert scanner.end() == b""
    assert not scanner.done


def test_end_after_done_adds_nothing() -> None:
    scanner = _scan(_event(0), DONE)
    assert scanner.done and scanner.end() == b""
