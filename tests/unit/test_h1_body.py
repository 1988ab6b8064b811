"""`BodyBuffer`: a body read in pieces with flow control, without a socket.

A fake protocol records each pause and resume; the buffer must pause once past the high water
mark (not again on every further piece), resume once a reader took the bytes, and end with
b"" or with the error it was failed with.
"""

from __future__ import annotations

import asyncio

import pytest

from narwhal.h1_body import BodyBuffer


class FakeReading:
    """The protocol side: whether its socket is being read, and every switch."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")


def _buffer(high_water: int = 10) -> tuple[BodyBuffer, FakeReading]:
    reading = FakeReading()
    loop = asyncio.get_running_loop()
    return BodyBuffer(loop, reading.pause, reading.resume, high_water), reading


async def test_pieces_come_out_joined_in_order_then_the_end() -> None:
    body, _ = _buffer()
    body.feed(b"ab")
    body.feed(b"cd")
    assert await body.read_some() == b"abcd"
    body.feed(b"e")
    body.finish()
    assert await body.read_some() == b"e"  # what arrived before the end is still read
    assert await body.read_some() == b""
    assert await body.read_some() == b""
    assert body.complete and body.empty


async def test_reading_pauses_once_past_high_water_and_resumes_when_read() -> None:
    body, reading = _buffer(high_water=10)
    body.feed(b"x" * 10)
    assert reading.calls == []  # at the mark, not past it
    body.feed(b"x")
    body.feed(b"x" * 100)
    assert reading.calls == ["pause"] and body.paused
    assert len(await body.read_some()) == 111
    assert reading.calls == ["pause", "resume"] and not body.paused
    body.feed(b"x" * 5)
    assert await body.read_some() == b"x" * 5
    assert reading.calls == ["pause", "resume"]  # never paused, so nothing to resume


async def test_a_waiting_reader_wakes_on_data_on_the_end_and_on_failure() -> None:
    body, _ = _buffer()
    reader = asyncio.create_task(body.read_some())
    await asyncio.sleep(0)
    assert not reader.done()
    body.feed(b"hi")
    assert await reader == b"hi"

    reader = asyncio.create_task(body.read_some())
    await asyncio.sleep(0)
    body.finish()
    assert await reader == b""

    failed, _ = _buffer()
    reader = asyncio.create_task(failed.read_some())
    await asyncio.sleep(0)
    failed.fail(ConnectionResetError("gone"))
    with pytest.raises(ConnectionResetError, match="gone"):
        await reader


async def test_the_first_failure_wins_and_none_after_the_end() -> None:
    body, _ = _buffer()
    body.feed(b"kept")
    body.fail(ConnectionResetError("first"))
    body.fail(ValueError("second"))
    assert await body.read_some() == b"kept"  # bytes that arrived are read before the error
    with pytest.raises(ConnectionResetError, match="first"):
        await body.read_some()

    ended, _ = _buffer()
    ended.finish()
    ended.fail(ConnectionResetError("late"))  # the socket closing after a whole body
    assert await ended.read_some() == b""


async def test_a_dropped_body_loses_what_waits_and_raises_even_after_its_end() -> None:
    body, reading = _buffer(high_water=10)
    body.feed(b"x" * 11)
    body.drop(ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        await body.read_some()  # the 11 bytes are gone
    body.finish()
    with pytest.raises(ValueError, match="refused"):
        await body.read_some()
    assert reading.calls == ["pause"]  # the owner resumes reading itself, if it wants to

    waiting, _ = _buffer()
    reader = asyncio.create_task(waiting.read_some())
    await asyncio.sleep(0)
    waiting.drop(ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        await reader
