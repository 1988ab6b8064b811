"""A data-plane worker process: `python -m narwhal.process.worker --channel-fd F --index K`.

It serves the OpenAI endpoints on its own event loop from a `SO_REUSEPORT` listener on the
router's port, placing requests over a replica of the control process's fleet. It never
decides anything about an engine: leg outcomes go to the control process as events, and
snapshots come back. `/ready` and `/health` are answered here (load balancers' probes never
wait on the control process); `/metrics` and `/admin/*` are forwarded to the control
process, so they read the same whichever worker accepted the connection.

It dies with the control process (`PR_SET_PDEATHSIG`), and stops admitting when the control
process goes quiet (`gate.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from importlib import resources
from typing import Any

import aiohttp
import orjson
import uvloop

from narwhal.clock import SystemClock
from narwhal.config import Config, ConfigError, EngineConfig, parse_config
from narwhal.dataplane.errors import error_answer, error_body
from narwhal.dataplane.exchange import Answer
from narwhal.dataplane.models import models_list
from narwhal.dataplane.pool import Pool
from narwhal.dataplane.plane import DataPlane
from narwhal.dataplane.request_ids import numbered_ids
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient
from narwhal.fleet.codec import decode
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.replica import FleetReplica
from narwhal.process.channel import Channel, Frame
from narwhal.process.gate import CONTROL_LOST, GateData, WorkerGate
from narwhal.process.h1_server import H1Server, Handler, ServerRequest
from narwhal.process.reporter import Reporter
from narwhal.process.table import (
    ENDPOINT_COLUMN,
    POOL_WAITING,
    SharedBudget,
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
NDJSON = "application/x-ndjson"

_PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 70
STATS_INTERVAL_S = 0.25


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the control process dies (even by SIGKILL): no orphan keeps
    the port. The check after closes the race where the parent died before the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:
        os._exit(EXIT_ORPHANED)


class Worker:
    def __init__(self, index: int, hello: Frame, channel: Channel) -> None:
        self.index = index
        self._queue_share: int = hello["queue_limit"]
        self.config: Config = self._own(hello["config"])
        config = self.config
        self.clock = SystemClock()
        self.table = WorkerTable(hello["table_fd"], hello["rows"])
        # The members come with the first (full) snapshot, each with its config and column.
        self._configs: dict[str, EngineConfig] = {}
        self._in_flight = SharedInFlight(self.table, index)
        self.fleet = FleetReplica((), self.clock, in_flight=self._in_flight)
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
            note=lambda event, engine, what: channel.send(
                "note", event=event, engine=engine, what=what
            ),
        )
        self.control_socket: str = hello["control_socket"]
        self._session: aiohttp.ClientSession | None = None  # to the control process
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
            self.channel.send("seen", version=frame["version"])
        elif kind == "gate":
            self.gate.data = GateData.from_json(frame["gate"])
        elif kind == "ack":
            self.reporter.acked(frame["upto"])
        elif kind == "config":  # reloaded (control/reload.py)
            self.config = self._own(frame["config"])
            self.dataplane.reconfigure(self.config)
            if self._tls is not None and self.config.tls.enabled:
                try:
                    tls_load(self._tls, self.config.tls)
                except ConfigError as exc:  # changed since the control process loaded it
                    log.error("reload: keeping the TLS certificate in use: %s", exc)
        elif kind == "move":
            self.dataplane.move_streams(frame["engine"])
        elif kind == "drain":
            self.grace_s = frame["grace_s"]
            self.drain.set()

    def on_lost(self) -> None:
        self.gate.lost = True
        self.grace_s = 0.0
        self.drain.set()

    # ---------------------------------------------------------------- HTTP
    def build_server(self) -> H1Server:
        """The worker's routes on `H1Server`; every other path is the control process's."""
        dataplane, table, row = self.dataplane, self.table, self.index
        worker = {"X-Narwhal-Worker": str(self.index)}

        def endpoint(name: Any) -> Handler:
            column = ENDPOINT_COLUMN[name]

            async def handle(request: ServerRequest) -> None:
                table.add(row, column, 1)  # what a crash of this worker would lose
                try:
                    result = await dataplane.handle(name, request)
                finally:
                    table.add(row, column, -1)
                if isinstance(result, Answer):
                    request.answer(result)

            return handle

        async def embeddings(request: ServerRequest) -> None:
            result = await dataplane.handle("embeddings", request)
            if isinstance(result, Answer):  # always: embeddings are never streamed
                request.answer(result)

        def passthrough(path: str) -> Handler:
            async def handle(request: ServerRequest) -> None:
                request.answer(await dataplane.passthrough(path, request))

            return handle

        async def health(request: ServerRequest) -> None:
            request.respond(200, b"ok", "text/plain", worker)

        async def ready(request: ServerRequest) -> None:
            reason = self.gate.ready(self.fleet)
            if reason is None:
                request.respond(200, b"ready", "text/plain", worker)
            else:
                request.respond(503, reason.encode(), "text/plain", worker)

        async def models(request: ServerRequest) -> None:
            refused, _ = dataplane.authenticate(request.header("authorization"))
            if refused is not None:
                request.answer(refused)
                return
            served = self.fleet.servable_models(self.clock.monotonic())
            request.respond(200, orjson.dumps(models_list(served)), "application/json")

        page = resources.files("narwhal.telemetry").joinpath("dashboard.html").read_bytes()

        async def dashboard(request: ServerRequest) -> None:
            request.respond(200, page, "text/html")

        routes: dict[str, dict[str, Handler]] = {
            "/v1/completions": {"POST": endpoint("completions")},
            "/v1/chat/completions": {"POST": endpoint("chat")},
            "/v1/models": {"GET": models},
            "/v1/embeddings": {"POST": embeddings},
            "/tokenize": {"POST": passthrough("/tokenize")},
            "/detokenize": {"POST": passthrough("/detokenize")},
            "/health": {"GET": health},
            "/ready": {"GET": ready},
            "/dashboard": {"GET": dashboard},
        }
        return H1Server(routes, self.forward)

    async def forward(self, request: ServerRequest) -> None:
        """`/metrics`, `/admin/*` and anything unknown: answered by the control process."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.control_socket, limit=8),
                auto_decompress=False,
            )
        cap = self.config.serving.max_body_bytes + 1024
        if request.content_length is not None and request.content_length > cap:
            request.respond(
                413, error_body(f"request body exceeds {cap} bytes", "invalid_request_error", 413),
                "application/json",
            )  # fmt: skip
            return
        body = await request.read()
        headers = {
            k: v
            for k in ("Authorization", "Content-Type", "Accept")
            if (v := request.headers.get(k.lower())) is not None
        }
        try:
            async with self._session.request(
                request.method, "http://control" + request.path_qs, data=body, headers=headers
            ) as answer:
                content_type = answer.headers.get("Content-Type", "")
                if answer.status == 200 and content_type.startswith(NDJSON):
                    # A progress stream (`narwhal readmit`): passed on as it comes.
                    await request.start_stream({}, NDJSON)
                    async for piece in answer.content.iter_any():
                        await request.send(piece)
                    await request.end()
                    return
                payload = await answer.read()
                out = {
                    k: v
                    for k in ("WWW-Authenticate", "Retry-After", "Allow")
                    if (v := answer.headers.get(k)) is not None
                }
                content_type = answer.headers.get("Content-Type", "application/octet-stream")
                request.respond(answer.status, payload, content_type, out)
        except (aiohttp.ClientError, OSError):
            request.answer(
                error_answer(
                    503, CONTROL_LOST, "service_unavailable", "control_lost", retry_after_s=1
                )
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
            self.channel.send("stats", engines=engines, timeline=[requests, errors, latency])

    async def run(self, host: str, port: int) -> None:
        await self.client.start()
        server = self.build_server()
        try:
            await server.start(host, port, self._tls)
            self.channel.send("ready", pid=os.getpid())
            async with asyncio.TaskGroup() as tg:
                lag = tg.create_task(watch_loop_lag(self.metrics.loop_lag))
                stats = tg.create_task(self.ship_stats())
                await self.drain.wait()
                self.gate.draining = True
                # Stop accepting, close idle connections, let running requests finish
                # within the grace, then cut off what is left.
                await server.drain(self.grace_s)
                lag.cancel()
                stats.cancel()
            self.send_stats()  # the last counts, before the exit closes the channel
            self.channel.flush()
        finally:
            await server.drain(0.0)
            if self._session is not None:
                await self._session.close()
            await self.client.close()
            await self.dataplane.close()


async def _main(channel_fd: int, index: int) -> int:
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
    die_with_parent(first["control_pid"])
    logs.configure(*first["log"])
    _use_multiprocess_metrics(first["metrics_id"])
    worker = Worker(index, first, channel)
    for frame in early:
        worker.on_frame(frame)
    # SIGTERM to this worker alone: drain it (the control process restarts it).
    loop.add_signal_handler(signal.SIGTERM, worker.drain.set)
    await worker.run(first["host"], first["port"])
    return 0


def _use_multiprocess_metrics(ident: str) -> None:
    """Count the data plane's metrics in files under `PROMETHEUS_MULTIPROC_DIR`, which the
    control process sums at each scrape; they outlive a crash of this worker. Must run
    before any metric exists; `ident` names this worker's files (no getpid per update)."""
    from prometheus_client import values

    values.ValueClass = values.MultiProcessValue(lambda: ident)  # type: ignore[no-untyped-call]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal-worker")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the control process decides
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload is the control process's
    # The data plane runs on uvloop: with the engine legs on protocols (engine/h1.py) the
    # event loop is a large share of a request's CPU (docs/performance-log.md, "uvloop in the
    # workers"). The control process stays on asyncio.
    with (
        contextlib.suppress(ConnectionError),
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        return runner.run(_main(args.channel_fd, args.index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
