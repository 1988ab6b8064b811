"""One simulated engine process: the HTTP app, the KV side channel, and fault actions.

`SimServer.run` owns everything it starts (structured: the background work lives in a task
group and shutdown is cancellation) and returns once `stop` is set.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable, Sequence

from aiohttp import web

from narwhal.clock import Clock
from narwhal.sim.app import SimApp
from narwhal.sim.config import SimConfig
from narwhal.sim.engine import SimEngine
from narwhal.sim.faults import IMMEDIATE, Fault, FaultBook, FaultKind, FaultSpec
from narwhal.sim.kv_publisher import KvEventPublisher, PublisherConfig
from narwhal.sim.kv_store import KvStore
from narwhal.sim.latency import Sleeper, pause
from narwhal.sim.listener import HttpListener
from narwhal.sim.metrics import CacheInfo, SimMetrics
from narwhal.sim.prefix_cache import PrefixCache
from narwhal.sim.request_log import RequestLog
from narwhal.sim.side_channel import SideChannelServer
from narwhal.sim.tokens import load_tokenizer

log = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 0.25  # a stalled request does not hold up a SIGTERM
_REOPEN_RETRY_S = 0.1


class SimServer:
    def __init__(
        self,
        config: SimConfig,
        *,
        clock: Clock,
        rng: random.Random,
        sleeper: Sleeper = asyncio.sleep,
        faults: Sequence[FaultSpec] = (),
    ) -> None:
        self.config = config
        self._clock = clock
        self._rng = rng
        self._sleeper = sleeper
        self._startup_faults = tuple(faults)

    async def run(self, started: Callable[[str], None], stop: asyncio.Event) -> None:
        """Serve until `stop` is set; `started(url)` is called once connections are accepted."""
        c = self.config
        cache = None
        if c.kv_blocks:
            # Seeded per process, as vLLM's block hashes: no two engines share them.
            cache = PrefixCache(c.kv_blocks, c.block_size, os.urandom(16))
        metrics = SimMetrics(c.model, CacheInfo(c.block_size, c.kv_blocks) if cache else None)
        faults = FaultBook(self._rng, metrics.fault_fired)
        store = KvStore(self._clock, c.kv_ttl_s)
        publisher = self._publisher(faults)
        side = SideChannelServer(store, c.engine_id, metrics.kv_blocks_served.inc)
        side_port = await side.start(c.host)
        try:
            if publisher is not None:
                publisher.open()
            engine = SimEngine(
                c,
                clock=self._clock,
                rng=self._rng,
                sleeper=self._sleeper,
                store=store,
                faults=faults,
                metrics=metrics,
                side_channel_port=side_port,
                cache=cache,
                publish=publisher.publish if publisher is not None else lambda events: None,
                tokenizer=load_tokenizer(c.tokenizer),
            )
            metrics.watch(
                running=lambda: engine.running,
                waiting=lambda: engine.waiting,
                start_time=lambda: engine.start_time,
                handoffs_held=store.held,
                kv_cache_usage=engine.kv_cache_usage,
            )
            await self._serve_http(engine, faults, metrics, publisher, started, stop)
        finally:
            if publisher is not None:
                publisher.close()
            await side.close()

    def _publisher(self, faults: FaultBook) -> KvEventPublisher | None:
        c = self.config
        if c.kv_events_port is None:
            return None
        config = PublisherConfig(
            host=c.host,
            port=c.kv_events_port,
            replay_port=c.kv_events_replay_port,
            topic=c.kv_events_topic,
            encoding=c.kv_events_encoding,
            hash_format=c.kv_events_block_hash,
            drop_fraction=c.kv_events_drop_fraction,
        )
        return KvEventPublisher(config, clock=self._clock, rng=self._rng, faults=faults)

    async def _serve_http(
        self,
        engine: SimEngine,
        faults: FaultBook,
        metrics: SimMetrics,
        publisher: KvEventPublisher | None,
        started: Callable[[str], None],
        stop: asyncio.Event,
    ) -> None:
        c = self.config
        reopen: asyncio.Task[None] | None = None
        async with asyncio.TaskGroup() as tg:
            replay = tg.create_task(publisher.serve_replay()) if publisher is not None else None

            def apply_fault(spec: FaultSpec) -> Fault:
                nonlocal reopen
                if spec.kind not in IMMEDIATE:
                    return faults.add(spec)
                fault = faults.new(spec)
                faults.record_fired(fault)
                if spec.kind is FaultKind.RESTART:
                    log.info("restart fault: KV dropped, new generation")
                    engine.restart()
                    if publisher is not None:
                        publisher.restart_sequence()
                elif spec.kind is FaultKind.KV_EVENTS_RESTART:
                    if publisher is not None:
                        publisher.restart_sequence()
                else:
                    if reopen is not None:
                        reopen.cancel()
                    reopen = tg.create_task(self._refuse(listener, spec.duration_s))
                return fault

            app = SimApp(
                engine,
                faults=faults,
                metrics=metrics,
                log=RequestLog(),
                clock=self._clock,
                sleeper=self._sleeper,
                apply_fault=apply_fault,
                publisher=publisher,
            ).build()
            runner = web.AppRunner(
                app,
                handler_cancellation=True,
                access_log=None,
                shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
            )
            await runner.setup()
            listener = HttpListener(runner, c.host, c.port)
            try:
                port = await listener.open()
                started(f"http://{c.host}:{port}")
                for spec in self._startup_faults:
                    apply_fault(spec)
                await stop.wait()
            finally:
                if reopen is not None:
                    reopen.cancel()
                if replay is not None:
                    replay.cancel()
                await runner.cleanup()

    async def _refuse(self, listener: HttpListener, duration_s: float | None) -> None:
        """Refuse connections for `duration_s` (None: for good), then listen again.

        Open keep-alive connections are closed too (idle ones at once, busy ones after their
        response), so a client cannot keep using a pooled connection.
        """
        log.info("refusing connections for %s s", duration_s)
        connections = await listener.close()
        async with asyncio.TaskGroup() as tg:
            for handler in connections:
                handler.close()  # as aiohttp's own shutdown: wakes an idle connection first
                tg.create_task(handler.shutdown(None))
            await pause(self._sleeper, duration_s)
            while True:
                try:
                    await listener.open()
                    break
                except OSError as exc:
                    log.warning("cannot listen again on port %d yet: %s", listener.port, exc)
                    await self._sleeper(_REOPEN_RETRY_S)
