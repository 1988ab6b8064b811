"""A data-plane worker process, forked by the zygote (`process/zygote.py`), which calls `main`
with `--channel-fd F --table-fd T --index K`.

It serves the OpenAI endpoints on its own event loop from a `SO_REUSEPORT` listener on the
router's port, placing requests over a replica of the control process's fleet. It never
decides anything about an engine: leg outcomes go to the control process as events, and
snapshots come back. The client API (`process/routes.py`, the same table as with one process)
is answered here, `/ready` and `/health` included (load balancers' probes never wait on the
control process); `/metrics`, `/admin/*` and the dashboard are forwarded to the control
process, so they read the same whichever worker accepted the connection.

It dies with its parent, the zygote, which dies with the control process (`PR_SET_PDEATHSIG`
both), and stops admitting when the control process goes quiet (`gate.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import Any

import uvloop

from narwhal.clock import SystemClock
from narwhal.config import Config, ConfigError, EngineConfig, parse_config
from narwhal.dataplane.flow_gate import FlowGate, TicketedInFlight
from narwhal.dataplane.plane import DataPlane
from narwhal.dataplane.pool import Pool
from narwhal.dataplane.prefix import PrefixPlacement
from narwhal.dataplane.request_ids import numbered_ids
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient
from narwhal.fleet.codec import decode
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.replica import FleetReplica
from narwhal.flow.messages import FromDataPlane
from narwhal.placement.load import EngineLoad
from narwhal.process.channel import Channel, Frame
from narwhal.process.events import Noted, Placed, Ready, Seen, Stats, decode_answer
from narwhal.process.forward import ControlForward
from narwhal.process.gate import GateData, WorkerGate
from narwhal.process.h1_server import H1Server, client_limits
from narwhal.process.reporter import Reporter
from narwhal.process.routes import ClientSurface, client_routes
from narwhal.process.table import (
    ENDPOINT_COLUMN,
    POOL_WAITING,
    SharedBudget,
    SharedConnections,
    SharedInFlight,
    SharedSockets,
    WorkerTable,
)
from narwhal.telemetry import logs
from narwhal.telemetry.loop_lag import watch_loop_lag
from narwhal.telemetry.metrics import DataMetrics
from narwhal.telemetry.timeline import Timeline
from narwhal.tls import engine_context, server_context
from narwhal.tls import load as tls_load

log = logging.getLogger("narwhal.worker")

STATS_INTERVAL_S = 0.25


class _ChannelLink:
    """Flow control's events, to the control process over the channel."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def send(self, event: FromDataPlane) -> None:
        self._channel.send_event(event)


class Worker:
    def __init__(self, index: int, table_fd: int, hello: Frame, channel: Channel) -> None:
        self.index = index
        self._queue_share: int = hello["queue_limit"]
        self.config: Config = self._own(hello["config"])
        config = self.config
        self.clock = SystemClock()
        self.table = WorkerTable(table_fd, hello["rows"])
        # The members come with the first (full) snapshot, each with its config and column.
        self._configs: dict[str, EngineConfig] = {}
        self._in_flight = SharedInFlight(self.table, index)
        # Placements tell flow control a granted request is now an engine's in-flight one.
        self.fleet = FleetReplica((), self.clock, in_flight=TicketedInFlight(self._in_flight))
        self.gate = WorkerGate(self.clock)
        self.channel = channel
        self.reporter = Reporter(channel, self.fleet, hello["settle_s"])
        self.stats = IntervalStats(float("inf"), self.clock.monotonic())
        self.timeline = Timeline()
        limit = config.serving.max_connections
        self.client = EngineClient(
            limit,
            1,
            ssl_context=engine_context(config.engine.ca_file),
            data_sockets=SharedSockets(self.table, index, limit),
        )
        self._tls = server_context(config.tls)
        budget = SharedBudget(self.table, index, limit)
        self.pool = Pool("data", limit, on_change=self._mirror_waiting, shared=budget)
        self.metrics = DataMetrics()  # built after `_use_multiprocess_metrics`
        self.dataplane = DataPlane(
            self.config,
            self.fleet,
            self.client,
            self.reporter,
            self.metrics,
            self.clock,
            self.gate,
            numbered_ids(hello["request_prefix"]),
            Adapters(self.client, self.clock, self.config.engine.probe_timeout_s),
            stats=self.stats,
            timeline=self.timeline,
            pool=self.pool,
            note=lambda event, engine, what: channel.send_event(Noted(event, engine, what)),
            prefix=PrefixPlacement(
                self.config,
                self.clock,
                share=lambda model, engine, keys: channel.send_event(
                    Placed(model, engine, tuple(keys))
                ),
            ),
        )
        self.flow = FlowGate(config, _ChannelLink(channel), index, self.clock.monotonic)
        self.dataplane.flow = self.flow
        self.control_socket: str = hello["control_socket"]
        self.forward = ControlForward(
            self.control_socket, config.admin.resolve_token(), config.serving.max_body_bytes
        )
        self.drain = asyncio.Event()
        self.grace_s: float = hello["grace_s"]

    def _own(self, data: Any) -> Config:
        """The control process's config with this worker's share of the wait queue
        (connections are shared: `SharedBudget`)."""
        config = parse_config(data)
        serving = config.serving.model_copy(update={"queue_limit": self._queue_share})
        return config.model_copy(update={"serving": serving})

    def _mirror_waiting(self, pool: Pool) -> None:
        row, table = self.index, self.table
        table.add(row, POOL_WAITING, pool.waiting - table.get(row, POOL_WAITING))

    # ---------------------------------------------------------------- frames
    def on_frame(self, frame: Frame) -> None:
        kind = frame["t"]
        if kind == "snap":
            configs = self._configs
            for e in frame["engines"]:
                if "config" in e:  # new to this worker, or relocated
                    configs[e["id"]] = EngineConfig.model_validate(e["config"])
                    self._in_flight.bind(e["id"], e["column"])
            self.fleet.load(
                (decode(e, configs[e["id"]]) for e in frame["engines"]),
                gone=frame["gone"],
                full=frame["full"],
            )
            for engine_id in frame["gone"]:
                configs.pop(engine_id, None)
            self.gate.data = GateData.from_json(frame["gate"])
            self.channel.send_event(Seen(frame["version"]))
        elif kind == "gate":
            self.gate.data = GateData.from_json(frame["gate"])
        elif kind == "ack":
            self.reporter.acked(frame["upto"])
        elif kind in ("start", "refuse", "preempt"):  # flow control's answer, or a preemption
            self.flow.answer(decode_answer(frame, self.index))
        elif kind == "config":  # reloaded (control/reload.py)
            self.config = self._own(frame["config"])
            self.dataplane.reconfigure(self.config)
            self.flow.reconfigure(self.config)
            if self._tls is not None and self.config.tls.enabled:
                try:
                    tls_load(self._tls, self.config.tls)
                except ConfigError as exc:  # changed since the control process loaded it
                    log.error("reload: keeping the TLS certificate in use: %s", exc)
        elif kind == "placed":  # another worker's placement (cache-aware, DESIGN §11)
            self.dataplane.prefix.placed_elsewhere(frame["model"], frame["engine"], frame["keys"])
        elif kind == "loads":  # the engines' own load, scraped by the control process
            self.dataplane.prefix.set_loads(
                {
                    engine: EngineLoad(int(w), int(r), float(kv), float(at), capacity)
                    for engine, (w, r, kv, at, capacity) in frame["loads"].items()
                }
            )
        elif kind == "move":
            self.dataplane.move_streams(frame["engine"])
        elif kind == "drain":
            self.grace_s = frame["grace_s"]
            self.drain.set()

    def on_lost(self) -> None:
        # Nobody will answer the requests waiting to start: 503 now, the client retries.
        self.flow.close("not_admitted", "not admitting requests: control process lost", False)
        self.gate.lost = True
        self.grace_s = 0.0
        self.drain.set()

    # ---------------------------------------------------------------- HTTP
    def build_server(self) -> H1Server:
        """The client API's routes (`process/routes.py`) on `H1Server`; every other path is
        the control process's."""
        table, row = self.table, self.index

        def in_progress(endpoint: str, delta: int) -> None:
            column = ENDPOINT_COLUMN.get(endpoint)
            if column is not None:
                table.add(row, column, delta)  # what a crash of this worker would lose

        surface = ClientSurface(
            self.dataplane,
            lambda: self.gate.ready(self.fleet),
            lambda: self.fleet.servable_models(self.clock.monotonic()),
            self.forward,
            {"X-Narwhal-Worker": str(self.index)},
            in_progress,
        )
        serving = self.config.serving
        rejected = self.metrics.client_rejected
        return H1Server(
            client_routes(surface),
            self.forward,
            limits=client_limits(serving),
            budget=SharedConnections(table, row, serving.max_client_connections),
            on_reject=lambda reason: rejected.labels(reason).inc(),
        )

    # ---------------------------------------------------------------- run
    async def ship_stats(self) -> None:
        """Every `STATS_INTERVAL_S`: this worker's request counts and latency buckets, as
        deltas the control process merges into its windows and timeline."""
        while True:
            await self.clock.sleep(STATS_INTERVAL_S)
            self.send_stats()

    def send_stats(self) -> None:
        window = self.stats.take(self.clock.monotonic())
        requests, errors, latency = self.timeline.take()
        engines = {
            e: [w.requests, w.latency.sparse(), w.inter_token.sparse()]
            for e, w in window.engines.items()
        }
        if engines or requests:
            self.channel.send_event(Stats(engines, (requests, errors, latency)))

    async def run(self, host: str, port: int) -> None:
        await self.client.start()
        server = self.build_server()
        try:
            await server.start(host, port, self._tls)
            self.channel.send_event(Ready(os.getpid()))
            async with asyncio.TaskGroup() as tg:
                lag = tg.create_task(watch_loop_lag(self.metrics.loop_lag, self.metrics.loop_stall))
                stats = tg.create_task(self.ship_stats())
                interval_s = self.config.placement.metrics_interval_s
                prefix = tg.create_task(self.dataplane.prefix.run(lambda: self.fleet, interval_s))
                await self.drain.wait()
                self.gate.draining = True
                # Its waiting requests leave the queue and are answered now: another worker
                # or router serves their retry at once, not at the end of the grace.
                self.flow.close("not_admitted", "not admitting requests: draining", True)
                # Stop accepting, close idle connections, let running requests finish
                # within the grace, then cut off what is left.
                await server.drain(self.grace_s)
                lag.cancel()
                stats.cancel()
                prefix.cancel()
            self.send_stats()  # the last counts, before the exit closes the channel
            self.channel.flush()
        finally:
            await server.drain(0.0)
            await self.forward.close()
            await self.client.close()
            await self.dataplane.close()


async def _main(channel_fd: int, table_fd: int, index: int) -> int:
    loop = asyncio.get_running_loop()
    hello: asyncio.Future[Frame] = loop.create_future()
    early: list[Frame] = []
    worker: Worker | None = None

    def on_frame(frame: Frame) -> None:
        if worker is not None:
            worker.on_frame(frame)
        elif frame["t"] == "hello" and not hello.done():
            hello.set_result(frame)
        else:
            early.append(frame)

    def on_lost() -> None:
        if worker is not None:
            worker.on_lost()
        elif not hello.done():
            hello.set_exception(ConnectionError("control process closed the channel"))

    sock = socket.socket(fileno=channel_fd)
    channel = await Channel.open(sock, on_frame, on_lost)
    first = await hello
    logs.configure(*first["log"])
    _use_multiprocess_metrics(first["metrics_id"])
    worker = Worker(index, table_fd, first, channel)
    for frame in early:
        worker.on_frame(frame)
    # SIGTERM to this worker alone: drain it (the control process restarts it).
    loop.add_signal_handler(signal.SIGTERM, worker.drain.set)
    await worker.run(first["host"], first["port"])
    return 0


def _use_multiprocess_metrics(ident: str) -> None:
    """Count the data plane's metrics in files under `PROMETHEUS_MULTIPROC_DIR`, which the
    control process sums at each scrape; they outlive a crash of this worker. Must run
    before any metric exists; `ident` names this worker's files (no getpid per update).

    Each update writes the file at once, as prometheus_client's own value does, without its
    lock and its fork check: a worker updates metrics only from its event loop's thread and
    forks nothing (the zygote forked it before any metric existed). A request makes about
    eight updates (counters, and a histogram's sum and bucket), each of which took the lock and
    called the fork check (docs/performance-log.md). It reads prometheus_client's value
    internals (`_value`, `_file`, `_key`), pinned by the lock file; the worker-metrics tests
    fail if a new version moves them."""
    from prometheus_client import values

    base: Any = values.MultiProcessValue(lambda: ident)  # type: ignore[no-untyped-call]

    class WorkerValue(base):  # type: ignore[misc]
        def inc(self, amount: float) -> None:
            self._value += amount
            self._timestamp = 0.0
            self._file.write_value(self._key, self._value, 0.0)

        def set(self, value: float, timestamp: float | None = None) -> None:
            self._value = value
            self._timestamp = timestamp or 0.0
            self._file.write_value(self._key, value, self._timestamp)

        def get(self) -> float:
            value: float = self._value
            return value

    values.ValueClass = WorkerValue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal-worker")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--table-fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the control process decides
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload is the control process's
    # The data plane runs on uvloop: with the engine legs on protocols (engine/h1.py) the
    # event loop is a large share of a request's CPU (docs/performance-log.md, "uvloop in the
    # workers"); `narwhal-serve` runs the control process on it too (`cli/serve.py`).
    with (
        contextlib.suppress(ConnectionError),
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        return runner.run(_main(args.channel_fd, args.table_fd, args.index))
    return 0
