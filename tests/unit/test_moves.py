"""Planned maintenance moves a stream by cancelling its task with a reason, and only that
cancellation is taken back."""

from __future__ import annotations

import asyncio
import contextlib

from narwhal.dataplane.leg import Attempt
from narwhal.dataplane.moves import PREEMPTED, Moves, is_move


async def _stream(moves: Moves, attempt: Attempt, reading: asyncio.Event) -> str:
    """A stream's read as the streaming leg does it: registered while it reads."""
    moves.register("d0", attempt, "req-1")
    try:
        reading.set()
        await asyncio.Event().wait()  # the engine's next chunk, never coming
        return "read"
    except asyncio.CancelledError:
        if not is_move(attempt):
            raise
        task = asyncio.current_task()
        assert task is not None
        task.uncancel()
        return "moved"
    finally:
        moves.unregister("d0", attempt, "req-1")


async def test_a_move_ends_the_read_and_is_taken_back() -> None:
    moves, attempt, reading = Moves(), Attempt("r1", {}), asyncio.Event()
    task = asyncio.create_task(_stream(moves, attempt, reading))
    await reading.wait()
    assert moves.move("d0") == 1
    assert await task == "moved"
    assert task.cancelling() == 0  # nothing left pending for the request's later awaits
    assert moves.move("d0") == 0  # unregistered


async def test_a_client_that_leaves_at_the_same_moment_wins() -> None:
    moves, attempt, reading = Moves(), Attempt("r1", {}), asyncio.Event()
    task = asyncio.create_task(_stream(moves, attempt, reading))
    await reading.wait()
    moves.move("d0")
    task.cancel()  # the server cancels the handler: the client disconnected
    cancelled = False
    try:
        await task
    except asyncio.CancelledError:
        cancelled = True
    assert cancelled, "the client's cancellation was swallowed"


async def test_only_the_engine_s_streams_move() -> None:
    moves, attempt, reading = Moves(), Attempt("r1", {}), asyncio.Event()
    task = asyncio.create_task(_stream(moves, attempt, reading))
    await reading.wait()
    assert moves.move("d1") == 0
    assert not attempt.moved
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_preemption_moves_one_request_s_stream_with_its_cause() -> None:
    moves, attempt, reading = Moves(), Attempt("r1", {}), asyncio.Event()
    task = asyncio.create_task(_stream(moves, attempt, reading))
    await reading.wait()
    assert moves.reading("req-1") is attempt
    assert moves.preempt("req-2") is False  # not reading a stream
    assert moves.preempt("req-1") is True
    assert moves.preempt("req-1") is False  # asked once: the first cause stands
    assert moves.move("d0") == 1 and attempt.moved == PREEMPTED
    assert await task == "moved"
    assert moves.reading("req-1") is None
