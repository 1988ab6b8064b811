"""The engine's KV-event publisher: vLLM's ZMQ PUB socket and its replay ROUTER socket.

Each published message is `[topic, sequence (8 bytes, big-endian), EventBatch (msgpack)]`, the
sequence counting from 0 per publisher. The last `buffer_steps` batches are kept for replay: a
client on the ROUTER socket sends a start sequence (8 bytes, big-endian; a REQ client's empty
delimiter frame is answered in kind) and gets one `[sequence, payload]` message per kept batch
from there, then `[-1 (8 bytes, signed), b""]`.

Faults: a share of messages is dropped (`drop_fraction`, and `kv_events_drop` faults), their
numbers spent, so a subscriber sees a gap that replay can fill; while a `kv_events_silent`
fault is active nothing is sent and replay requests go unanswered; `restart_sequence` starts
the numbering again at 0 with an empty replay buffer, as a restarted engine does.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from narwhal.clock import Clock
from narwhal.sim.faults import FaultBook, FaultKind
from narwhal.sim.kv_events import BlockHashFormat, EventEncoding, KvEvent, encode_batch

log = logging.getLogger(__name__)

END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
_HWM = 100_000


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    host: str
    port: int  # 0: any free port
    replay_port: int | None  # None: no replay socket; 0: any free port
    topic: str = ""
    encoding: EventEncoding = EventEncoding.MAP
    hash_format: BlockHashFormat = BlockHashFormat.INT
    drop_fraction: float = 0.0
    buffer_steps: int = 10_000


def _bind_address(host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port or '*'}"


class KvEventPublisher:
    def __init__(
        self, config: PublisherConfig, *, clock: Clock, rng: random.Random, faults: FaultBook
    ) -> None:
        self.config = config
        self._clock = clock
        self._rng = rng
        self._faults = faults
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self.port = 0
        self.replay_port: int | None = None
        self.published = 0
        self.dropped = 0

    def open(self) -> None:
        """Bind the sockets (the ports are known once this returns)."""
        c = self.config
        ipv6 = ":" in c.host
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, _HWM)
        pub.setsockopt(zmq.IPV6, ipv6)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub
        _bind(pub, _bind_address(c.host, c.port))
        self.port = _port_of(pub)
        if c.replay_port is not None:
            replay = self._async_ctx.socket(zmq.ROUTER)
            # A ROUTER drops what passes its high-water mark (1,000 by default), the end
            # marker included: a replay of a longer buffer would never end for the client.
            replay.setsockopt(zmq.SNDHWM, _HWM)
            replay.setsockopt(zmq.IPV6, ipv6)
            replay.setsockopt(zmq.LINGER, 0)
            self._replay = replay
            _bind(replay, _bind_address(c.host, c.replay_port))
            self.replay_port = _port_of(replay)

    def close(self) -> None:
        for sock in (self._replay, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.destroy(linger=0)

    @property
    def next_sequence(self) -> int:
        return self._next_seq

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Number, keep and send one batch (never blocks: PUB drops above its high-water
        mark, as vLLM's does)."""
        if not events or self._pub is None:
            return
        c = self.config
        payload = encode_batch(
            self._clock.wall(), events, encoding=c.encoding, hash_format=c.hash_format
        )
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if self._faults.fire(FaultKind.KV_EVENTS_SILENT) or self._drops():
            self.dropped += 1
            return
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        self.published += 1

    def restart_sequence(self) -> None:
        """Number from 0 again and forget the replay buffer (a new publisher)."""
        self._next_seq = 0
        self._buffer.clear()

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            if self._faults.fire(FaultKind.KV_EVENTS_SILENT):
                continue
            await self._answer(frames)

    async def _answer(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        identity, *rest = frames
        if len(rest) == 2 and rest[0] == b"":
            envelope, start = [identity, b""], rest[1]
        elif len(rest) == 1:
            envelope, start = [identity], rest[0]
        else:
            log.warning("malformed KV-event replay request: %d frames", len(frames))
            return
        if len(start) != 8:
            log.warning("malformed KV-event replay request: a %d-byte sequence", len(start))
            return
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                await self._replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
        await self._replay.send_multipart([*envelope, END_SEQUENCE, b""])

    def _drops(self) -> bool:
        if self._faults.fire(FaultKind.KV_EVENTS_DROP):
            return True
        fraction = self.config.drop_fraction
        return fraction > 0 and self._rng.random() < fraction


def _bind(sock: zmq.Socket[bytes] | zmq.asyncio.Socket, address: str) -> None:
    """Bind, a failure as the OSError start-up reports (a port in use, an unknown host)."""
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"KV events: cannot bind {address}: {exc.strerror}") from exc


def _port_of(sock: zmq.Socket[bytes] | zmq.asyncio.Socket) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return int(endpoint.decode().rsplit(":", 1)[1])
