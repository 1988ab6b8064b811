"""The control process <-> worker channel (DESIGN §9), over a real Unix socket pair.

- `Channel`: frames sent in one loop turn leave together at the end of the turn, in order;
  a frame split across many writes (even inside a UTF-8 character) is delivered once, whole;
  a trailing partial frame at EOF is dropped and `on_lost` is called exactly once; `close()`
  flushes what is pending first and calls `on_lost` once.
- `Reporter`: a success with no evidence to clear sends nothing; a failure sends an `ev`
  frame; `settled()` returns at once when acknowledged (or nothing to wait for), waits for
  `acked(seq)` otherwise, and gives up after its short timeout when no ack comes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import orjson
import pytest

from narwhal.clock import FakeClock
from narwhal.config import parse_config
from narwhal.engine.failures import EngineFailure, FailureClass, SuccessKind
from narwhal.fleet.store import Fleet
from narwhal.process.channel import Channel, Frame
from narwhal.process.events import LegFailed, LegSucceeded, decode
from narwhal.process.reporter import Reporter
from tests.support.fleet import force_state

TIMEOUT_S = 10.0  # a bound for what should take milliseconds; never the expected path


class Inbox:
    """One end's frames and losses, with a way to await them."""

    def __init__(self, on_frame: Callable[[Frame], None] | None = None) -> None:
        self.frames: list[Frame] = []
        self.lost = 0
        self._hook = on_frame
        self._changed = asyncio.Event()

    def on_frame(self, frame: Frame) -> None:
        self.frames.append(frame)
        self._changed.set()
        if self._hook is not None:
            self._hook(frame)

    def on_lost(self) -> None:
        self.lost += 1
        self._changed.set()

    async def wait_for(self, frames: int) -> None:
        async with asyncio.timeout(TIMEOUT_S):
            while len(self.frames) < frames:
                self._changed.clear()
                await self._changed.wait()


class Traced(Channel):
    """A channel that also says when asyncio is done with its transport (`connection_lost`,
    the last callback), so a test can check `on_lost` was not called again by then."""

    transport_gone: asyncio.Future[None]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport_gone = asyncio.get_running_loop().create_future()
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.transport_gone.set_result(None)

    async def gone(self) -> None:
        async with asyncio.timeout(TIMEOUT_S):
            await self.transport_gone


async def open_traced(sock: socket.socket, inbox: Inbox) -> Traced:
    channel = await Traced.open(sock, inbox.on_frame, inbox.on_lost)
    assert isinstance(channel, Traced)
    return channel


def raw_peer() -> tuple[socket.socket, socket.socket]:
    """(the channel's socket, the other end, non-blocking for the loop's sock_* calls)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    return ours, theirs


def wire(frames: list[Frame]) -> bytes:
    return b"".join(orjson.dumps(f) + b"\n" for f in frames)


async def read_until_eof(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    async with asyncio.timeout(TIMEOUT_S):
        while chunk := await loop.sock_recv(sock, 65536):
            data += chunk
    return data


async def read_lines(sock: socket.socket, lines: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    async with asyncio.timeout(TIMEOUT_S):
        while data.count(b"\n") < lines:
            chunk = await loop.sock_recv(sock, 65536)
            assert chunk, f"EOF after {data!r}"
            data += chunk
    return data


def frames_of(data: bytes) -> list[Frame]:
    assert data.endswith(b"\n")
    return [orjson.loads(line) for line in data.split(b"\n")[:-1]]


# --------------------------------------------------------------------------- Channel
async def test_frames_sent_in_one_turn_leave_together_at_its_end() -> None:
    ours, theirs = raw_peer()
    inbox = Inbox()
    channel = await Channel.open(ours, inbox.on_frame, inbox.on_lost)
    try:
        channel.send("gate", n=1)
        channel.send("snap", n=2, note="line\nbreak ünïcode")  # no raw newline inside a frame
        channel.send("drain", n=3)
        with pytest.raises(BlockingIOError):
            theirs.recv(1)  # nothing is written before the turn ends
        data = await read_lines(theirs, 3)
        assert frames_of(data) == [
            {"t": "gate", "n": 1},
            {"t": "snap", "n": 2, "note": "line\nbreak ünïcode"},
            {"t": "drain", "n": 3},
        ]
        assert inbox.lost == 0
    finally:
        channel.close()
        theirs.close()


async def test_a_burst_between_two_channels_arrives_whole_and_in_order() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender_inbox, receiver = Inbox(), Inbox()
    sender = await Channel.open(a, sender_inbox.on_frame, sender_inbox.on_lost)
    receiving = await Channel.open(b, receiver.on_frame, receiver.on_lost)
    try:
        burst: list[Frame] = [
            {"t": "ev", "seq": i, "item": ["f", "d0", "x" * (i % 300)]} for i in range(3000)
        ]
        for frame in burst:  # ~0.5 MB in one turn: more than a socket buffer holds
            sender.send(frame["t"], seq=frame["seq"], item=frame["item"])
        await receiver.wait_for(len(burst))
        assert receiver.frames == burst
        assert (receiver.lost, sender_inbox.lost) == (0, 0)
    finally:
        sender.close()
        receiving.close()


async def test_a_frame_split_across_writes_is_delivered_once_complete() -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = raw_peer()
    inbox = Inbox()
    channel = await Channel.open(ours, inbox.on_frame, inbox.on_lost)
    frames: list[Frame] = [
        {"t": "snap", "version": 1, "engines": [{"id": "p0", "holds": {}}]},
        {"t": "gate", "gate": {"lease": None, "monitor": "✓✓✓ degraded", "valid_until": 1.5}},
        {"t": "seen", "version": 1},
    ]
    stream = wire(frames)
    starts = [0, *(i + 1 for i, byte in enumerate(stream[:-1]) if byte == ord("\n"))]
    # Cut in the middle of every frame, three bytes into each next one, and inside a UTF-8
    # character: every piece but the last ends inside a frame.
    cuts = sorted(
        {
            *(s + 3 for s in starts[1:]),
            *(s + 10 for s in starts),
            stream.index("✓".encode()) + 1,
            len(stream),
        }
    )
    try:
        sent = 0
        for cut in cuts:
            await loop.sock_sendall(theirs, stream[sent:cut])
            sent = cut
            # Let the channel read what completes a frame before the rest of the next one is
            # written, so the partial tail really waits in its buffer.
            await inbox.wait_for(stream[:sent].count(b"\n"))
        assert inbox.frames == frames
        assert inbox.lost == 0
    finally:
        channel.close()
        theirs.close()


async def test_a_trailing_partial_frame_at_eof_is_dropped_and_loss_told_once() -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = raw_peer()
    inbox = Inbox()
    channel = await open_traced(ours, inbox)
    whole: Frame = {"t": "ev", "seq": 1, "item": ["f", "d0", "timeout", "decode", "slow"]}
    await loop.sock_sendall(theirs, wire([whole]) + b'{"t":"ev","seq":2,"it')
    theirs.close()  # the worker died while writing its second frame
    await channel.gone()
    assert inbox.frames == [whole]
    assert inbox.lost == 1
    assert channel.closed


async def test_close_flushes_pending_frames_then_tells_the_loss_once() -> None:
    ours, theirs = raw_peer()
    inbox = Inbox()
    channel = await open_traced(ours, inbox)
    try:
        channel.send("drain", grace_s=30.0)
        channel.send("gate", gate=None)
        channel.close()  # same turn: the scheduled flush has not run yet
        assert inbox.lost == 1
        channel.send("late")  # refused quietly once closed
        assert frames_of(await read_until_eof(theirs)) == [
            {"t": "drain", "grace_s": 30.0},
            {"t": "gate", "gate": None},
        ]
        await channel.gone()
        assert inbox.lost == 1
        channel.close()  # a second close is harmless and tells nothing more
        assert inbox.lost == 1
    finally:
        theirs.close()


# --------------------------------------------------------------------------- Reporter
ENGINES = parse_config(
    {
        "model": "demo-model",
        "engines": [
            {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
        ],
    }
).engines


class Link:
    """A worker's `Reporter` on one end of a socket pair, the control process's inbox on the
    other (which acknowledges nothing unless the test says so)."""

    def __init__(
        self, worker: Channel, control: Channel, inbox: Inbox, fleet: Fleet, reporter: Reporter
    ) -> None:
        self.worker, self.control, self.inbox = worker, control, inbox
        self.fleet, self.reporter = fleet, reporter


@pytest.fixture
async def link() -> AsyncIterator[Link]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker_lost = Inbox()
    worker = await Channel.open(a, worker_lost.on_frame, worker_lost.on_lost)
    inbox = Inbox()
    control = await Channel.open(b, inbox.on_frame, inbox.on_lost)
    fleet = Fleet(ENGINES, FakeClock())
    yield Link(worker, control, inbox, fleet, Reporter(worker, fleet, settle_s=0.05))
    worker.close()
    control.close()


def completes_at_once(reporter: Reporter) -> bool:
    """Whether `settled()` returns without suspending even once."""
    coroutine = reporter.settled()
    try:
        coroutine.send(None)
    except StopIteration:
        return True
    coroutine.close()
    return False


def slow(detail: str = "no first token in 30 s") -> EngineFailure:
    return EngineFailure(FailureClass.TIMEOUT, detail)


async def test_success_without_evidence_sends_nothing(link: Link) -> None:
    link.reporter.success("d0", SuccessKind.DECODE_DONE, "decode")
    link.reporter.failure("d0", slow(), "decode")
    await link.inbox.wait_for(1)
    # Order is kept, so a success frame would have come first, and it would have taken seq 1.
    assert [decode(f) for f in link.inbox.frames] == [
        LegFailed(1, "d0", "decode", FailureClass.TIMEOUT, "no first token in 30 s")
    ]


async def test_success_with_evidence_to_clear_is_sent(link: Link) -> None:
    force_state(link.fleet, "p0", evidence={FailureClass.CONNECTION: 1})
    link.reporter.success("p0", SuccessKind.PREFILL_HANDOFF, "prefill")
    await link.inbox.wait_for(1)
    assert [decode(f) for f in link.inbox.frames] == [
        LegSucceeded(1, "p0", "prefill", SuccessKind.PREFILL_HANDOFF)
    ]


async def test_failures_carry_increasing_seqs(link: Link) -> None:
    link.reporter.failure("p0", EngineFailure(FailureClass.CONNECTION, "refused"), "prefill")
    link.reporter.failure("d0", EngineFailure(FailureClass.STREAM, "cut"), "decode")
    await link.inbox.wait_for(2)
    assert [decode(f) for f in link.inbox.frames] == [
        LegFailed(1, "p0", "prefill", FailureClass.CONNECTION, "refused"),
        LegFailed(2, "d0", "decode", FailureClass.STREAM, "cut"),
    ]


async def test_a_failure_keeps_its_whole_shape_from_the_leg_to_the_reducer(link: Link) -> None:
    """Status and timed_out survive the channel (the reducer and migration read them)."""
    failure = EngineFailure(FailureClass.STREAM, "silence", status=None, timed_out=True)
    link.reporter.failure("d0", failure, "decode")
    overloaded = EngineFailure(FailureClass.OVERLOAD, "HTTP 503", status=503)
    link.reporter.failure("d0", overloaded, "decode")
    await link.inbox.wait_for(2)
    got = [decode(f) for f in link.inbox.frames]
    assert all(isinstance(e, LegFailed) for e in got)
    first, second = (e.failure() for e in got)  # type: ignore[union-attr]
    assert (first.failure_class, first.detail) == (FailureClass.STREAM, "silence")
    assert first.timed_out
    assert (second.status, second.timed_out) == (503, False)


async def test_settled_returns_at_once_with_nothing_to_wait_for(link: Link) -> None:
    assert completes_at_once(link.reporter)  # nothing reported
    link.reporter.failure("d0", slow(), "decode")
    assert not completes_at_once(link.reporter)
    link.reporter.acked(1)
    assert completes_at_once(link.reporter)
    link.reporter.success("d0", SuccessKind.DECODE_DONE, "decode")  # successes are not waited on
    assert completes_at_once(link.reporter)


async def test_settled_returns_at_once_when_the_channel_is_closed(link: Link) -> None:
    link.reporter.failure("d0", slow(), "decode")
    link.worker.close()
    assert completes_at_once(link.reporter)


async def test_settled_waits_for_the_ack_of_the_last_failure(link: Link) -> None:
    reporter = link.reporter = Reporter(link.worker, link.fleet, settle_s=3600.0)  # only an ack
    reporter.failure("p0", slow(), "prefill")
    reporter.failure("d0", slow(), "decode")
    settled = asyncio.create_task(reporter.settled())
    await link.inbox.wait_for(2)
    reporter.acked(1)  # the first failure only
    # One more frame through the socket: the waiting task has had turns enough to run.
    link.worker.send("probe")
    await link.inbox.wait_for(3)
    assert not settled.done()
    reporter.acked(2)
    async with asyncio.timeout(TIMEOUT_S):
        await settled


async def test_settled_gives_up_without_an_ack(link: Link) -> None:
    link.reporter.failure("d0", slow(), "decode")
    async with asyncio.timeout(TIMEOUT_S):  # bounded by its own short timeout, not ours
        await link.reporter.settled()
    await link.inbox.wait_for(1)
    link.reporter.acked(1)  # a late ack finds the abandoned waiter and is harmless
    assert completes_at_once(link.reporter)
