"""`ServerRequest`, the handler's view of one request, against a fake connection.

The fake records what the request asks of its connection (`RequestConnection`): the bytes
written, each pause and resume of reading, the handler wanting the body, a stream starting,
an abort. No socket, no parser: the body arrives as the connection's parser would feed it.
"""

from __future__ import annotations

import asyncio

import pytest

from narwhal.dataplane.exchange import Answer, BodyRefused
from narwhal.h1_body import HIGH_WATER
from narwhal.process.h1_request import ServerRequest
from narwhal.process.h1_state import Refusal

DATE = b"Sun, 06 Dec 2026 09:00:00 GMT"


class FakeConnection:
    """A `RequestConnection` that records every call; `full` makes `send` wait (the client's
    socket is full) until `drained` is set."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.written: list[bytes] = []
        self.calls: list[str] = []
        self.wanted: list[ServerRequest] = []
        self.open = True  # not draining, not closing
        self.gone = False
        self.drained = asyncio.Event()
        self.drained.set()

    def date(self) -> bytes:
        return DATE

    def write(self, data: bytes) -> None:
        self.written.append(data)

    async def send(self, data: bytes) -> None:
        if self.gone:
            raise ConnectionResetError("the client disconnected")
        self.written.append(data)
        await self.drained.wait()

    def pause_body(self) -> None:
        self.calls.append("pause")

    def resume_body(self) -> None:
        self.calls.append("resume")

    def want_body(self, request: ServerRequest) -> None:
        self.wanted.append(request)

    def keeps_open(self) -> bool:
        return self.open

    def streaming(self) -> None:
        self.calls.append("streaming")

    def abort(self) -> None:
        self.calls.append("abort")


def _request(
    method: str = "POST", path: str = "/v1/completions", query: str = ""
) -> tuple[ServerRequest, FakeConnection]:
    connection = FakeConnection()
    return ServerRequest(connection, method, path, query), connection


def _head_of(data: bytes) -> tuple[bytes, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines:
        name, _, value = line.partition(": ")
        fields[name.lower()] = value
    return status.encode(), fields, body


# ---------------------------------------------------------------------- the head
async def test_the_head_is_read_as_the_parser_left_it() -> None:
    request, _ = _request("GET", "/v1/models", "a=1")
    request.headers["authorization"] = "Bearer k"
    assert request.header("authorization") == "Bearer k"
    assert request.header("x-missing") is None
    assert request.path_qs == "/v1/models?a=1"
    assert _request("GET", "/health")[0].path_qs == "/health"


# ---------------------------------------------------------------------- the body
async def test_the_first_read_wants_the_body_and_later_reads_are_the_buffers_own() -> None:
    request, connection = _request()
    request.body.feed(b'{"a":')
    assert connection.wanted == []  # nothing asked before the handler reads (no 100 yet)
    assert await request.read_some() == b'{"a":'
    assert connection.wanted == [request]
    # The hot path: no call of the request's own between the handler and the buffer.
    assert request.read_some == request.body.read_some
    request.body.feed(b"1}")
    request.body.finish()
    assert await request.read() == b"1}"
    assert connection.wanted == [request]  # said once
    assert request.body_complete


async def test_a_reader_waits_for_the_body_as_it_arrives() -> None:
    request, _ = _request()
    reader = asyncio.create_task(request.read())
    await asyncio.sleep(0)
    assert not reader.done()
    request.body.feed(b"ab")
    await asyncio.sleep(0)
    request.body.feed(b"cd")
    request.body.finish()
    assert await reader == b"abcd"


async def test_a_full_buffer_pauses_the_connection_until_the_handler_reads() -> None:
    request, connection = _request()
    request.body.feed(b"x" * HIGH_WATER)
    assert connection.calls == []  # at the mark, not past it
    request.body.feed(b"x")
    request.body.feed(b"x")
    assert connection.calls == ["pause"]  # once
    assert len(await request.read_some()) == HIGH_WATER + 2
    assert connection.calls == ["pause", "resume"]


async def test_a_refused_body_drops_what_was_buffered_and_every_read_raises() -> None:
    request, _ = _request()
    request.body.feed(b"part of a body too large")
    request.refuse(Refusal(413, "body_too_large", "request body over 1024 bytes"))
    for _ in range(2):
        with pytest.raises(BodyRefused) as refused:
            await request.read_some()
        assert refused.value.status == 413 and "1024 bytes" in refused.value.message
    request.body.finish()  # whatever the parser still says
    with pytest.raises(BodyRefused):
        await request.read_some()


async def test_a_waiting_reader_learns_of_a_refusal_and_of_the_client_leaving() -> None:
    request, _ = _request()
    reader = asyncio.create_task(request.read())
    await asyncio.sleep(0)
    request.refuse(Refusal(408, "body_timeout", "request body too slow"))
    with pytest.raises(BodyRefused) as refused:
        await reader
    assert refused.value.status == 408

    left, _ = _request()
    reader = asyncio.create_task(left.read())
    await asyncio.sleep(0)
    left.body.fail(ConnectionResetError("the client disconnected"))  # what the connection does
    with pytest.raises(ConnectionResetError):
        await reader


async def test_a_whole_body_is_still_read_after_the_client_left() -> None:
    request, _ = _request()
    request.body.feed(b"all of it")
    request.body.finish()
    request.body.fail(ConnectionResetError("the client disconnected"))
    assert await request.read() == b"all of it"


# ---------------------------------------------------------------------- the answer
async def test_a_whole_answer_goes_out_in_one_write_and_keeps_the_connection() -> None:
    request, connection = _request()
    request.body.finish()
    request.respond(201, b'{"ok":true}', "application/json", {"X-Request-Id": "r1"})
    assert request.answered and request.finished
    [data] = connection.written
    status, fields, body = _head_of(data)
    assert status == b"HTTP/1.1 201 Created"
    assert fields == {
        "content-type": "application/json",
        "date": DATE.decode(),
        "x-request-id": "r1",
        "content-length": "11",
    }
    assert body == b'{"ok":true}'


async def test_an_answer_to_head_has_the_length_and_no_body() -> None:
    request, connection = _request("HEAD", "/health")
    request.body.finish()
    request.answer(Answer(200, b"ok", "text/plain"))
    status, fields, body = _head_of(connection.written[0])
    assert status == b"HTTP/1.1 200 OK" and fields["content-length"] == "2" and body == b""


@pytest.mark.parametrize(
    "case",
    ["body not all in", "client said close", "connection closing or draining", "refused"],
)
async def test_the_head_says_close_when_the_connection_cannot_stay(case: str) -> None:
    request, connection = _request()
    if case != "body not all in":
        request.body.finish()
    if case == "client said close":
        request.keep_alive = False
    elif case == "connection closing or draining":
        connection.open = False
    elif case == "refused":
        request.refuse(Refusal(413, "body_too_large", "too large"))
    request.respond(413 if case == "refused" else 200, b"{}", "application/json")
    assert _head_of(connection.written[0])[1]["connection"] == "close"


async def test_an_unknown_status_still_has_a_reason_and_a_second_answer_is_a_bug() -> None:
    request, connection = _request()
    request.body.finish()
    request.respond(599, b"", "text/plain")
    assert _head_of(connection.written[0])[0] == b"HTTP/1.1 599 Unknown"
    with pytest.raises(AssertionError, match="answered twice"):
        request.respond(200, b"", "text/plain")


async def test_a_stream_is_chunked_and_ends_once() -> None:
    request, connection = _request()
    request.body.finish()
    await request.start_stream({"X-Request-Id": "r2"})
    assert connection.calls == ["streaming"]
    assert request.answered and not request.finished
    status, fields, _ = _head_of(connection.written[0])
    assert status == b"HTTP/1.1 200 OK"
    assert fields["content-type"] == "text/event-stream"
    assert fields["cache-control"] == "no-cache"
    assert fields["transfer-encoding"] == "chunked"
    assert fields["x-request-id"] == "r2"
    assert "content-length" not in fields and "connection" not in fields
    await request.send(b"data: 1\n\n")
    await request.send(b"")  # nothing to frame: no zero chunk that would end the stream
    await request.send(b"x" * 26)
    await request.end()
    await request.end()
    assert connection.written[1:] == [
        b"9\r\ndata: 1\n\n\r\n",
        b"1a\r\n" + b"x" * 26 + b"\r\n",
        b"0\r\n\r\n",
    ]
    assert request.finished


async def test_a_stream_waits_while_the_client_is_not_reading() -> None:
    request, connection = _request()
    request.body.finish()
    await request.start_stream({}, content_type="application/x-ndjson")
    assert _head_of(connection.written[0])[1]["content-type"] == "application/x-ndjson"
    connection.drained.clear()  # the client's socket is full
    sending = asyncio.create_task(request.send(b"{}\n"))
    await asyncio.sleep(0)
    assert not sending.done()
    connection.drained.set()
    await sending
    connection.gone = True
    with pytest.raises(ConnectionResetError):
        await request.send(b"{}\n")


async def test_sending_before_the_stream_started_is_a_bug_and_cut_off_aborts() -> None:
    request, connection = _request()
    with pytest.raises(AssertionError, match="start_stream"):
        await request.send(b"x")
    with pytest.raises(AssertionError, match="start_stream"):
        await request.end()
    request.cut_off()
    assert connection.calls == ["abort"]
