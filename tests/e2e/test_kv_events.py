"""KV-event ingestion over real ZMQ sockets, against a publisher in its own process.

The publisher (this file run as a script) binds a PUB socket (an XPUB, wire-compatible, so the
test can wait for the subscription instead of sleeping) and, optionally, a ROUTER replay socket
answering as vLLM's does; the test tells it over stdin what to send, skip, or garble, and kills
it with SIGKILL to restart it. The subscriber under test is `subscribe` feeding a `Placement`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio

from narwhal.clock import SystemClock
from narwhal.config import KvEventsConfig
from narwhal.placement.facade import EngineCounters, Placement
from narwhal.placement.subscriber import KvEventsEndpoint, subscribe
from narwhal.sim import kv_events as sim
from tests.support.poll import eventually

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks
TOPIC = "kv"


# --- the publisher process ------------------------------------------------------------------


def _publisher_main(pub_address: str, replay_address: str | None) -> None:
    """Bind, print the endpoints, then obey stdin commands until killed."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.IPV6, 1)
    pub.bind(pub_address)
    router = None
    if replay_address is not None:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.IPV6, 1)
        router.setsockopt(zmq.SNDHWM, 0)  # a long replay is sent whole, never dropped here
        router.bind(replay_address)
    buffer: list[tuple[int, bytes]] = []
    subscribed = False
    replays: list[int] = []
    endpoints = {
        "pub": pub.getsockopt_string(zmq.LAST_ENDPOINT),
        "replay": None if router is None else router.getsockopt_string(zmq.LAST_ENDPOINT),
    }
    print(json.dumps(endpoints), flush=True)
    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    if router is not None:
        poller.register(router, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if pub in ready:
            subscribed = subscribed or pub.recv().startswith(b"\x01")
        if router is not None and router in ready:
            client, _, start = router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            replays.append(first)
            for seq, payload in buffer:
                if seq >= first:
                    router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])
        if sys.stdin.fileno() in ready:
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            reply: Any = "ok"
            if cmd["op"] == "publish":
                payload = bytes.fromhex(cmd["payload"])
                buffer.append((cmd["seq"], payload))
                if cmd["live"]:
                    pub.send_multipart([TOPIC.encode(), cmd["seq"].to_bytes(8, "big"), payload])
            elif cmd["op"] == "buffer_many":  # kept for replay only, as if sent long ago
                payload = bytes.fromhex(cmd["payload"])
                buffer += [(seq, payload) for seq in range(cmd["first"], cmd["end"])]
            elif cmd["op"] == "raw":
                pub.send_multipart([bytes.fromhex(f) for f in cmd["frames"]])
            elif cmd["op"] == "state":
                reply = {"subscribed": subscribed, "replays": replays}
            print(json.dumps(reply), flush=True)


# --- the test's side ------------------------------------------------------------------------


@dataclass
class Publisher:
    proc: asyncio.subprocess.Process
    endpoint: KvEventsEndpoint
    pub: str
    replay: str | None

    async def _ask(self, cmd: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()
        return json.loads(await asyncio.wait_for(self.proc.stdout.readline(), 10))

    async def publish(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        await self._ask({"op": "publish", "seq": seq, "payload": payload.hex(), "live": live})

    async def buffer_many(self, first: int, end: int, payload: bytes) -> None:
        await self._ask({"op": "buffer_many", "first": first, "end": end, "payload": payload.hex()})

    async def raw(self, *frames: bytes) -> None:
        await self._ask({"op": "raw", "frames": [f.hex() for f in frames]})

    async def state(self) -> dict[str, Any]:
        state: dict[str, Any] = await self._ask({"op": "state"})
        return state

    async def subscribed(self) -> None:
        async def probe() -> bool:
            return bool((await self.state())["subscribed"])

        await eventually(probe, timeout_s=10, what="the subscription to reach the publisher")

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()


async def _start_publisher(pub: str, replay: str | None) -> Publisher:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        pub,
        replay or "-",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout is not None
    endpoints = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
    endpoint = KvEventsEndpoint(endpoints["pub"], endpoints["replay"], TOPIC)
    return Publisher(proc, endpoint, endpoints["pub"], endpoints["replay"])


@dataclass
class Harness:
    placement: Placement
    publisher: Publisher

    def counters(self) -> EngineCounters:
        counters = self.placement.counters("e1")
        assert counters is not None
        return counters

    def matched(self) -> int:
        keys = self.placement.keys("m", TOKENS)
        found = self.placement.match("m", keys, now=0.0).get("e1")
        return 0 if found is None else found.matched_tokens

    async def matched_becomes(self, tokens: int) -> None:
        await eventually(lambda: self.matched() == tokens, what=f"{tokens} tokens matched")


@asynccontextmanager
async def _harness(
    *, replay: bool, replay_at: str | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[Harness]:
    at = f"tcp://{host}:*"
    publisher = await _start_publisher(at, at if replay else None)
    if replay_at is not None:
        publisher.endpoint = KvEventsEndpoint(publisher.pub, replay_at, TOPIC)
    placement = Placement()
    placement.set_engine(
        "e1",
        model="m",
        block_size_tokens=BS,
        capacity_tokens=4096,
        has_events=True,
        has_replay=replay,
    )
    ctx = zmq.asyncio.Context()
    harness = Harness(placement, publisher)
    try:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(
                subscribe(
                    "e1",
                    publisher.endpoint,
                    placement,
                    context=ctx,
                    clock=SystemClock(),
                    replay_timeout_s=1.0,
                )
            )
            await harness.publisher.subscribed()
            yield harness
            task.cancel()
    finally:
        if harness.publisher.proc.returncode is None:
            await harness.publisher.kill()
        # Every socket was closed on cancellation, or term() would wait for it forever.
        await asyncio.wait_for(asyncio.to_thread(ctx.term), 5)


def _digest(n: int) -> bytes:
    return n.to_bytes(32, "big")


def _stored(first_block: int, blocks: int, encoding: sim.EventEncoding) -> bytes:
    """Blocks first_block.. of TOKENS, chained on the previous one."""
    parent = None if first_block == 0 else _digest(first_block - 1)
    tokens = TOKENS[first_block * BS : (first_block + blocks) * BS]
    hashes = tuple(_digest(i) for i in range(first_block, first_block + blocks))
    event = sim.BlockStored(hashes, parent, tuple(tokens), BS)
    return sim.encode_batch(1.0, [event], encoding=encoding, hash_format=sim.BlockHashFormat.BYTES)


def _removed(block: int) -> bytes:
    event = sim.BlockRemoved((_digest(block),))
    return sim.encode_batch(
        1.0, [event], encoding=sim.EventEncoding.MAP, hash_format=sim.BlockHashFormat.BYTES
    )


async def test_in_order_batches_in_every_layout_then_removal_and_clear() -> None:
    async with _harness(replay=False) as h:
        for seq, encoding in enumerate(sim.EventEncoding):
            await h.publisher.publish(seq, _stored(seq * 2, 2, encoding))
        await h.matched_becomes(24)
        await h.publisher.publish(3, _removed(4))
        await h.matched_becomes(16)
        clear = sim.encode_batch(2.0, [sim.AllBlocksCleared()], encoding=sim.EventEncoding.ARRAY)
        await h.publisher.publish(4, clear)
        await eventually(lambda: h.counters().clears == 1, what="the clear")
        assert h.matched() == 0 and h.placement.index_blocks("e1") == 0
        c = h.counters()
        assert (c.batches, c.stored_blocks, c.removed_blocks, c.gaps) == (5, 6, 1, 0)


async def test_an_ipv6_publisher_is_followed_and_replayed() -> None:
    """`engines[].kv_events` takes a bracketed IPv6 endpoint (tcp://[::1]:PORT), as ZMQ
    writes one: the subscription and its replay socket both reach it."""
    async with _harness(replay=True, host="[::1]") as h:
        assert h.publisher.endpoint.endpoint.startswith("tcp://[::1]:")
        KvEventsConfig(endpoint=h.publisher.endpoint.endpoint)  # the config takes it
        await h.publisher.publish(0, _stored(0, 2, sim.EventEncoding.MAP))
        await h.matched_becomes(2 * BS)
        await h.publisher.publish(1, _stored(2, 2, sim.EventEncoding.MAP), live=False)  # lost
        await h.publisher.publish(2, _stored(4, 2, sim.EventEncoding.MAP))
        await h.matched_becomes(6 * BS)  # seq 1 came by the replay socket
        assert (await h.publisher.state())["replays"] == [1]


async def test_a_gap_is_replayed() -> None:
    async with _harness(replay=True) as h:
        await h.publisher.publish(0, _stored(0, 2, sim.EventEncoding.MAP))
        await h.matched_becomes(8)
        await h.publisher.publish(1, _stored(2, 2, sim.EventEncoding.MAP), live=False)  # lost
        await h.publisher.publish(2, _stored(4, 2, sim.EventEncoding.MAP))
        await h.matched_becomes(24)
        await h.publisher.publish(3, _removed(5))
        await h.matched_becomes(20)
        assert (await h.publisher.state())["replays"] == [1]
        c = h.counters()
        assert (c.replays, c.gaps, c.batches, c.duplicates) == (1, 0, 4, 1)


async def test_a_first_message_past_zero_replays_from_the_start() -> None:
    async with _harness(replay=True) as h:
        await h.publisher.publish(0, _stored(0, 3, sim.EventEncoding.ARRAY), live=False)
        await h.publisher.publish(1, _stored(3, 3, sim.EventEncoding.ARRAY))
        await h.matched_becomes(24)
        assert (await h.publisher.state())["replays"] == [0]


async def test_a_long_replay_leaves_the_event_loop_free() -> None:
    """Subscribing late to a publisher with 20,000 batches in its replay buffer (vLLM keeps
    10,000): the replay is applied whole, and the event loop of the process doing it (every
    request there, or the control process's heartbeats) is never held meanwhile."""
    gaps: list[float] = []

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.005)
            now = loop.time()
            gaps.append(now - last)
            last = now

    async with _harness(replay=True) as h:
        n = 20_000
        await h.publisher.buffer_many(0, n, _stored(0, 2, sim.EventEncoding.ARRAY))
        tick = asyncio.create_task(ticker())
        try:
            await h.publisher.publish(n, _stored(2, 1, sim.EventEncoding.ARRAY))
            await h.matched_becomes(12)  # the live batch, after the replay
        finally:
            tick.cancel()
        c = h.counters()
        assert (c.replays, c.batches, c.gaps) == (1, n + 1, 0), "the whole buffer replayed"
    assert max(gaps) < 0.25, f"the loop was held for {max(gaps):.2f}s"


async def test_a_gap_without_replay_forgets_the_engine() -> None:
    async with _harness(replay=False) as h:
        await h.publisher.publish(0, _stored(0, 2, sim.EventEncoding.MAP))
        await h.matched_becomes(8)
        await h.publisher.publish(1, _stored(2, 2, sim.EventEncoding.MAP), live=False)
        await h.publisher.publish(2, _stored(4, 2, sim.EventEncoding.MAP))
        await eventually(lambda: h.counters().gaps == 1, what="the gap")
        assert h.matched() == 0
        c = h.counters()
        assert (c.missed_batches, c.unkeyable_blocks) == (1, 2)
        # A new prompt start is keyed again.
        await h.publisher.publish(3, _stored(0, 1, sim.EventEncoding.MAP))
        await h.matched_becomes(4)


async def test_garbage_is_counted_and_the_stream_goes_on() -> None:
    async with _harness(replay=False) as h:
        await h.publisher.publish(0, _stored(0, 2, sim.EventEncoding.MAP))
        await h.publisher.raw(TOPIC.encode(), b"\x00\x01", b"short sequence")
        await h.publisher.raw(TOPIC.encode())
        await h.publisher.raw(TOPIC.encode(), (1).to_bytes(8, "big"), b"\xc1 not msgpack")
        await eventually(lambda: h.counters().decode_errors == 3, what="three decode errors")
        assert h.matched() == 0  # the undecodable batch's removals are unknown: forgotten
        await h.publisher.publish(2, _stored(0, 1, sim.EventEncoding.MAP))
        await h.matched_becomes(4)
        assert h.counters().gaps == 0


@pytest.mark.parametrize("replay", [True, False])
async def test_a_killed_and_restarted_publisher_starts_the_engine_over(replay: bool) -> None:
    async with _harness(replay=replay) as h:
        for seq in range(3):
            await h.publisher.publish(seq, _stored(seq * 2, 2, sim.EventEncoding.MAP))
        await h.matched_becomes(24)
        await h.publisher.kill()
        h.publisher = await _start_publisher(h.publisher.pub, h.publisher.replay)
        await h.publisher.subscribed()  # the SUB socket reconnected by itself
        await h.publisher.publish(0, _stored(0, 1, sim.EventEncoding.ARRAY))
        await eventually(lambda: h.counters().restarts == 1, what="the restart")
        await h.matched_becomes(4)
        assert h.placement.index_blocks("e1") == 1


async def test_an_unanswered_replay_gives_the_gap_up() -> None:
    silent = zmq.asyncio.Context()
    hole = silent.socket(zmq.ROUTER)  # takes replay requests and never answers
    try:
        hole.bind("tcp://127.0.0.1:*")
        async with _harness(replay=True, replay_at=hole.getsockopt_string(zmq.LAST_ENDPOINT)) as h:
            await h.publisher.publish(0, _stored(0, 2, sim.EventEncoding.MAP))
            await h.matched_becomes(8)
            await h.publisher.publish(3, _stored(2, 1, sim.EventEncoding.MAP))
            await eventually(lambda: h.counters().replay_failures == 1, what="the replay to fail")
            assert h.counters().missed_batches == 2 and h.matched() == 0
            assert await asyncio.wait_for(hole.recv_multipart(), 5)  # it was asked
            # Replays are not asked for again for a while: the next gap is given up at once.
            await h.publisher.publish(6, _stored(0, 1, sim.EventEncoding.MAP))
            await eventually(lambda: h.counters().gaps == 2, what="the second gap")
            await h.matched_becomes(4)
            assert h.counters().replays == 1
            assert h.counters().gaps_seen == 2, "the first gap counted once, not again given up"
    finally:
        hole.close(linger=0)
        silent.term()


if __name__ == "__main__":
    _publisher_main(sys.argv[1], None if sys.argv[2] == "-" else sys.argv[2])
