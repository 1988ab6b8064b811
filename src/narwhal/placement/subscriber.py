"""The I/O edge of KV-event ingestion: one SUB socket per engine, and replays over a DEALER.

`subscribe` runs until cancelled (inside the app's task group, one task per engine): it receives
`[topic, 8-byte big-endian sequence, payload]` messages and hands them to the sink
(`Placement.on_batch`), which decides; when the decision asks for a replay, it fetches the
missed sequences from the engine's ROUTER replay endpoint (send the start sequence as 8 bytes,
receive `[sequence, payload]` until the sequence is -1), feeds them as replayed, then feeds the
message that revealed the gap again. Malformed messages are counted and logged by the sink, never
raised. Sockets are closed on the way out, whether by cancellation or error; nothing blocks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from narwhal.clock import Clock
from narwhal.placement.stream import SeqDecision

log = logging.getLogger("narwhal.placement")

END_OF_REPLAY = -1
SEQUENCE_BYTES = 8
# Messages handled between two yields to the event loop. A message already queued on the
# socket completes `recv` without yielding, so a replay of the publisher's whole buffer (vLLM
# keeps 10,000 batches) or a burst of live events would otherwise hold the loop for seconds:
# every request in this process, and the control process's heartbeats, waited behind it.
YIELD_EVERY = 32


@dataclass(frozen=True, slots=True)
class KvEventsEndpoint:
    """Where an engine publishes (`engines[].kv_events` in the config)."""

    endpoint: str
    """The PUB socket, `tcp://HOST:PORT`."""
    replay_endpoint: str | None = None
    """The ROUTER replay socket, `tcp://HOST:PORT`, or None when the engine has none."""
    topic: str = ""


class EventSink(Protocol):
    def on_batch(
        self, engine: str, seq: int, payload: bytes, now: float, *, replayed: bool = False
    ) -> SeqDecision | None: ...

    def on_replay_failed(self, engine: str, now: float) -> None: ...

    def on_garbage(self, engine: str, reason: str) -> None: ...


async def subscribe(
    engine: str,
    endpoint: KvEventsEndpoint,
    sink: EventSink,
    *,
    context: zmq.asyncio.Context,
    clock: Clock,
    replay_timeout_s: float = 2.0,
) -> None:
    """Follow one engine's events until cancelled (ZMQ reconnects by itself after a restart)."""
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)  # a bracketed IPv6 endpoint too (IPv4 unchanged)
        sub.connect(endpoint.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, endpoint.topic.encode("utf-8"))
        log.info("kv events: %s: subscribed to %s", engine, endpoint.endpoint)
        received = 0
        while True:
            received += 1
            if received % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            frames = await sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != SEQUENCE_BYTES:
                sink.on_garbage(engine, f"{len(frames)} frames, not [topic, sequence, payload]")
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            payload = frames[2]
            decision = sink.on_batch(engine, seq, payload, clock.monotonic())
            if decision is None or decision.replay_from is None:
                continue
            if endpoint.replay_endpoint is None:  # the sink thought there was one
                sink.on_replay_failed(engine, clock.monotonic())
            else:
                await replay(
                    engine,
                    endpoint.replay_endpoint,
                    decision.replay_from,
                    sink,
                    context=context,
                    clock=clock,
                    timeout_s=replay_timeout_s,
                )
            sink.on_batch(engine, seq, payload, clock.monotonic(), replayed=True)
    finally:
        sub.close(linger=0)


async def replay(
    engine: str,
    address: str,
    start: int,
    sink: EventSink,
    *,
    context: zmq.asyncio.Context,
    clock: Clock,
    timeout_s: float,
) -> None:
    """Fetch sequences from `start` on and feed them to the sink as replayed.

    A fresh DEALER per replay, so that a late answer to an abandoned replay can never be taken
    for the next one's. Silence for `timeout_s` between two messages, or a malformed message,
    ends the replay as failed.
    """
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        # No bound on what is queued here: the engine's ROUTER drops what does not fit in its
        # send queue (1,000 messages by default), and its whole buffer comes at once.
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(address)
        # A DEALER speaks to a ROUTER expecting REQ peers: an empty delimiter frame first.
        await dealer.send_multipart([b"", start.to_bytes(SEQUENCE_BYTES, "big", signed=True)])
        count = 0
        while True:
            try:
                async with asyncio.timeout(timeout_s):
                    frames = await dealer.recv_multipart()
            except TimeoutError:
                log.warning(
                    "kv events: %s: replay from %d: no answer from %s within %.1fs",
                    engine,
                    start,
                    address,
                    timeout_s,
                )
                sink.on_replay_failed(engine, clock.monotonic())
                return
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 2 or len(frames[0]) != SEQUENCE_BYTES:
                sink.on_garbage(engine, f"replay answer of {len(frames)} frames")
                sink.on_replay_failed(engine, clock.monotonic())
                return
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == END_OF_REPLAY:
                log.info("kv events: %s: replayed %d batches from %d", engine, count, start)
                return
            count += 1
            sink.on_batch(engine, seq, frames[1], clock.monotonic(), replayed=True)
            if count % YIELD_EVERY == 0:
                await asyncio.sleep(0)
    finally:
        dealer.close(linger=0)
