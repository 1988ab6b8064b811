"""The router: wires the data plane, the control plane and durable state into one app.

`Router` owns every component (no globals) and runs the HTTP server and the monitor loop
in one task group; shutdown is cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from narwhal.clock import Clock, SystemClock
from narwhal.config import Config, ConfigError, load_config
from narwhal.control import config_watch
from narwhal.control.discovery import Discovery
from narwhal.control.engine_tasks import EngineTasks
from narwhal.control.evidence import EvidenceRecorder
from narwhal.control.flow import FlowService
from narwhal.control.health import HealthStages
from narwhal.control.lifecycle import Lifecycle
from narwhal.control.load_scrape import LoadScraper
from narwhal.control.membership import Membership, MembershipConflict
from narwhal.control.monitor import Monitor, Stage
from narwhal.control.operator import OperatorActions
from narwhal.control.ownership import Ownership
from narwhal.control.probes import InferenceProber
from narwhal.control.readmission import Readmission
from narwhal.control.reload import reload_changes
from narwhal.control.stages import SmallStages
from narwhal.control.suspects import SuspectProbes
from narwhal.dataplane.auth import key_problems
from narwhal.dataplane.flow_gate import FlowGate, TicketedInFlight
from narwhal.dataplane.plane import DataPlane
from narwhal.dataplane.prefix import PlacementCollector
from narwhal.dataplane.request_ids import numbered_ids, request_prefix
from narwhal.engine.registry import Adapters
from narwhal.engine.transport import EngineClient
from narwhal.fleet.admission import Admission
from narwhal.fleet.inflight import InFlight
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.readiness import fleet_ready_reason
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from narwhal.flow.messages import Tick
from narwhal.placement.load import EngineLoad
from narwhal.process.forward import ControlForward
from narwhal.process.h1_server import H1Server, Handler, LocalConnections, client_limits
from narwhal.process.routes import ClientSurface, client_routes
from narwhal.process.spawner import WorkerSpawner
from narwhal.process.supervisor import Supervisor, sweep_stale_runtime_dirs
from narwhal.process.table import CLIENT_CONNECTIONS, SharedInFlight, WorkerTable
from narwhal.state.atomic import Filesystem, remove_stale_temps
from narwhal.state.etcd_compaction import Compactor
from narwhal.state.etcd_status import EtcdStatusWatch, status_interval_s
from narwhal.state.etcd_store import EtcdLeaseStore
from narwhal.state.file_store import FileLeaseStore
from narwhal.state.handoff import (
    HandoffWriter,
    Verdict,
)
from narwhal.state.lease import LeaseKeeper, LeaseStore
from narwhal.state.lease import Role as LeaseRole
from narwhal.state.resume import continue_sequence, resume
from narwhal.telemetry import admin_views
from narwhal.telemetry.events import EventLog
from narwhal.telemetry.fleet_metrics import watch_fleet
from narwhal.telemetry.loop_lag import Observers, watch_loop_lag
from narwhal.telemetry.metrics import Metrics, SummedData, WorkerFiles
from narwhal.telemetry.timeline import Timeline
from narwhal.tls import engine_context, server_context
from narwhal.tls import load as tls_load

log = logging.getLogger("narwhal.router")


def make_store(config: Config, fs: Filesystem | None) -> LeaseStore:
    lease = config.lease
    if lease.backend == "etcd":
        return EtcdLeaseStore(lease.endpoints, lease.key, timeout_s=lease.renew_interval_s)
    return FileLeaseStore(Path(lease.path), Path(config.handoff.path), fs)


class Router:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        stage_overrides: Mapping[str, Stage] | None = None,
        new_request_id: Callable[[], str] | None = None,
        resume: bool = False,
        standby: bool = False,
        config_path: Path | None = None,
        filesystem: Filesystem | None = None,
        lease_store: LeaseStore | None = None,
        spawner: WorkerSpawner | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path  # re-read by a reload (SIGHUP, POST /admin/reload)
        self.clock = clock or SystemClock()
        self._wall_offset_s = self.clock.wall() - self.clock.monotonic()
        self.metrics = Metrics()
        # Data-plane worker processes (DESIGN §9), started by `run`; until then (and with one
        # process) this process's own data plane counts in-flight requests.
        self.workers = config.resolved_workers()
        self.supervisor: Supervisor | None = None
        # Forks the workers (a test session shares one; otherwise the router's own).
        self._spawner = spawner
        self._owns_spawner = spawner is None
        self.fleet = Fleet(config.engines, self.clock, Policy.of(config.recovery))
        watch_fleet(self.fleet, self.metrics, self.clock)
        self.admission = Admission()
        self.client = EngineClient(
            config.serving.max_connections,
            config.engine.control_connections,
            ssl_context=engine_context(config.engine.ca_file),
        )
        self._tls = server_context(config.tls)  # HTTPS on `listen`, re-read on reload
        self.adapters = Adapters(self.client, self.clock, config.engine.probe_timeout_s)
        self.stats = IntervalStats(
            config.controller.interval_s,
            self.clock.monotonic(),
            keep=max(10, config.controller.drift_intervals + 1),
        )
        self.timeline = Timeline()
        self.events = EventLog(self.clock)  # GET /admin/events, `narwhal events`
        self._record_events()
        self.evidence = EvidenceRecorder(self.fleet, self.clock, stats=self.stats)
        self.lifecycle = Lifecycle(self.fleet)
        self.engine_tasks = EngineTasks(self._spawn_engine_task)
        self.resume = resume
        self.resume_verdict: Verdict | None = None
        self.standby = standby
        self._build_data_plane(config, new_request_id)
        self._build_control_plane(config, rng)
        self._build_lease(config, filesystem, lease_store)
        self._build_monitor(config, stage_overrides)
        self._tasks: asyncio.TaskGroup | None = None

    def _build_data_plane(self, config: Config, new_request_id: Callable[[], str] | None) -> None:
        """This process's data plane, flow control's service and gate, and the pool and
        connection gauges."""
        # This process's request ids are `<prefix>-N` (each worker has its own, logged as it
        # starts): a leg an engine received names the process that placed it.
        self.request_prefix = request_prefix()
        # Placements tell flow control a granted request is now an engine's in-flight one.
        self.fleet.in_flight = TicketedInFlight(self.fleet.in_flight)
        self.dataplane = DataPlane(
            config,
            self.fleet,
            self.client,
            self.evidence,
            self.metrics.data,
            self.clock,
            self.admission,
            new_request_id or numbered_ids(self.request_prefix),
            self.adapters,
            stats=self.stats,
            timeline=self.timeline,
            note=self.events.add,
        )
        # Flow control (DESIGN §13): its one queue is this process's; with one process the
        # data plane asks it directly, with workers over their channels.
        self._loads: Mapping[str, EngineLoad] = {}
        self.flow = FlowService(
            config, self.fleet, self.clock, self.admission, self.metrics.flow, lambda: self._loads
        )
        self.flow_gate = FlowGate(config, self.flow, 0, self.clock.monotonic)
        self.dataplane.flow = self.flow_gate
        self.flow.deliver = self.flow_gate.answer
        m = self.metrics
        m.registry.register(PlacementCollector(self.dataplane.prefix))
        m.pool_limit.labels("data").set(config.serving.max_connections)
        m.pool_limit.labels("control").set(config.engine.control_connections)
        # Live gauges, read when /metrics is scraped, instead of a set() per request and leg.
        m.pool_in_use.labels("data").set_function(lambda: self.data_pool_usage()[0])
        m.pool_in_use.labels("control").set_function(lambda: self.client.control_in_use)
        m.pool_waiting.set_function(lambda: self.data_pool_usage()[1])
        self._connections = LocalConnections(config.serving.max_client_connections)
        m.client_connections.set_function(self.client_connections)

    def _build_control_plane(self, config: Config, rng: random.Random | None) -> None:
        """The monitor's stages' parts: health, suspects, probes, readmission, operator
        actions, membership and discovery."""
        self.health = HealthStages(
            config,
            self.fleet,
            self.client,
            self.evidence,
            self.lifecycle,
            self.metrics,
            self.adapters,
        )
        self.suspects = SuspectProbes(
            config,
            self.fleet,
            self.client,
            self.adapters,
            self.lifecycle,
            self.metrics,
            self.clock,
            self.engine_tasks,
        )
        self.evidence.on_effect(self.suspects.on_effect)
        self.prober = InferenceProber(
            config,
            self.fleet,
            self.client,
            self.lifecycle,
            self.metrics,
            self.clock,
            self.adapters,
        )
        self.readmission = Readmission(
            config,
            self.fleet,
            self.client,
            self.lifecycle,
            self.metrics,
            rng or random.Random(),
            self.prober,
            self.adapters,
            self.clock,
        )
        self.operator = OperatorActions(self.fleet, self.lifecycle, self.readmission, self.clock)
        self.small = SmallStages(
            config,
            self.fleet,
            self.lifecycle,
            self.metrics,
            self.stats,
            self.readmission.verify_kv_role,
            spawn=self._spawn,
        )
        self.membership = Membership(
            self.fleet,
            self.metrics,
            self.clock,
            config.fleet_api,
            config.model,
            self.publish,
            forgotten=[self._forget_engine],
        )
        self.discovery = (
            Discovery(config.discovery, self.membership, self.metrics, self.clock, self.is_active)
            if config.discovery.enabled
            else None
        )

    def _build_lease(
        self,
        config: Config,
        filesystem: Filesystem | None,
        lease_store: LeaseStore | None,
    ) -> None:
        """The handoff writer and, with a lease backend, ownership (the lease keeper, etcd's
        compaction and status) and the lease's admission check."""
        self.handoff = HandoffWriter(
            Path(config.handoff.path),
            config.effective_router_id,
            self.fleet,
            self.clock,
            lambda: self.small.risk,
            self._lease_json,
            fs=filesystem,
            on_dir_fsync_failure=self.metrics.handoff_dir_fsync_failures.inc,
        )
        self.ownership: Ownership | None = None
        self.compactor: Compactor | None = None  # etcd: the holder compacts its history
        self.etcd_status: EtcdStatusWatch | None = None  # etcd: size and alarms, every role
        if config.lease.backend != "none":
            store = lease_store or make_store(config, filesystem)
            if isinstance(store, FileLeaseStore):  # it writes the handoff under its lock
                store.on_handoff_unsynced = self.handoff.unsynced
            compaction_s = config.lease.compaction_interval_s
            if isinstance(store, EtcdLeaseStore):
                interval = status_interval_s(compaction_s)
                self.etcd_status = EtcdStatusWatch(store, self.metrics, interval, self.clock)
                if compaction_s > 0:
                    self.compactor = Compactor(store, compaction_s, self.metrics, self.clock)
            keeper = LeaseKeeper(config.effective_router_id, config.lease, store, self.clock)
            self.ownership = Ownership(
                config,
                keeper,
                self.fleet,
                self.handoff,
                self.metrics,
                self.clock,
                leadership=[self.compactor.run] if self.compactor else [],
                membership=self.membership,
            )
            self.handoff.guard = self.ownership.write_handoff
            keeper.on_event = lambda what: self.events.add("lease", None, what)
            self.admission.add_check(
                "lease", lambda: keeper.admission_reason(self.clock.monotonic())
            )

    def _build_monitor(self, config: Config, stage_overrides: Mapping[str, Stage] | None) -> None:
        """The monitor pass: its stages in order (a test may override some)."""
        stages: dict[str, Stage] = {
            "controller": self.small.controller,
            "health": self._health_stage,
            "drains": self._drains_stage,
            "rollover": self.small.rollover,
            "readmission": self._readmission_stage,
            "liveness": self.health.liveness,
            "telemetry": self._telemetry_stage,
            "handoff": self._handoff_stage,
        }
        stages.update(stage_overrides or {})
        self.monitor = Monitor(
            stages,
            config.controller.monitor_failure_limit,
            self.admission,
            self.metrics,
            self.clock,
        )

    async def _telemetry_stage(self, now: float) -> None:
        await self.small.telemetry(now)
        self.timeline.sample(self.clock.wall())
        self.metrics.admitting.set(int(self.admission.admitting))
        self.ready()

    async def _handoff_stage(self, now: float) -> None:
        t0 = time.perf_counter()
        try:
            await self.handoff.stage(now)
        except BaseException:
            self.metrics.handoff_writes.labels("failed").inc()
            raise
        self.metrics.handoff_writes.labels("ok").inc()
        self.metrics.handoff_write_seconds.observe(time.perf_counter() - t0)

    def _record_events(self) -> None:
        """Engine transitions and membership changes into the event timeline."""

        def transition(before: Any, after: Any, event: Any, step: Any) -> None:
            if step.reason is not None:
                self.events.add("transition", after.id, step.reason)

        def membership(engine_id: str, present: bool) -> None:
            self.events.add("membership", engine_id, "added" if present else "removed")

        self.fleet.observe(transition)
        self.fleet.observe_membership(membership)

    async def _drains_stage(self, now: float) -> None:
        """Drains settle; engines removed from the fleet are forgotten once theirs did."""
        await self.small.drains(now)
        self.membership.settle()

    def _forget_engine(self, engine_id: str) -> None:
        """An engine left the fleet: its background work stops, its records go."""
        self.engine_tasks.cancel(engine_id)
        self.small.drains_settled.pop(engine_id, None)
        self.readmission.last_results.pop(engine_id, None)

    async def _health_stage(self, now: float) -> None:
        """Health sweep, then (re)schedule inference probes for held engines."""
        await self.health.health(now)
        self.prober.schedule(self.engine_tasks)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Background work of the active router: in the leadership scope, so fencing (and
        shutdown) cancels it; None, `coro` closed, when this router does not lead. A plain
        task when the router is driven without `run` (tests)."""
        if self._tasks is None:
            return asyncio.get_running_loop().create_task(coro)
        if self.ownership is not None:
            return self.ownership.spawn(coro)
        return self._tasks.create_task(coro)

    def _spawn_engine_task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Probes and readmission attempts run only while the router serves."""
        if self._tasks is None:
            coro.close()
            return None
        return self._spawn(coro)

    async def _readmission_stage(self, now: float) -> None:
        """Start due readmission attempts as background tasks (a slow engine never delays
        the pass); shutdown cancels them with the task group."""
        self.readmission.schedule(now, self.engine_tasks)

    # ------------------------------------------------------------------ state views
    def publish(self) -> None:
        """Push engine changes to the data-plane workers now (no-op with one process)."""
        if self.supervisor is not None:
            self.supervisor.publish_now()

    async def reload(self) -> dict[str, Any]:
        """Re-read the config file and apply what a running router can (DESIGN §10): the
        engine set as membership changes (on the active router; a standby follows the
        active's), and timeouts and policies for new requests. Keys that need a restart are
        reported and left as they are. Raises ConfigError (the file does not validate) or
        MembershipConflict, and then nothing changed."""
        try:
            if self.config_path is None:
                raise ConfigError(["(file): this router was not started from a config file"])
            new = await asyncio.to_thread(load_config, self.config_path)
            problems = await asyncio.to_thread(key_problems, new.auth)
            if problems:
                raise ConfigError(problems)
            await asyncio.to_thread(server_context, new.tls)  # the files load
            changes = reload_changes(self.config, new)
            engines = None
            if "engines" in changes.applied and self.is_active():
                engines = self.membership.apply(new.engines, "reload").to_json()
        except (ConfigError, MembershipConflict):
            self.metrics.reloads.labels("refused").inc()
            raise
        self._reconfigure(changes.config)
        self.metrics.reloads.labels("ok").inc()
        applied = ", ".join(changes.applied) or "nothing changed"
        self.events.add("reload", None, f"applied: {applied}")
        log.info(
            "reload: applied %s; restart required for %s; engines %s",
            list(changes.applied) or "nothing",
            list(changes.restart_required) or "nothing",
            engines if engines is not None else "unchanged or followed from the active",
        )
        return {"reloaded": True, **changes.to_json(), "engines": engines}

    async def _reload_on_signal(self) -> None:
        """SIGHUP: a reload whose refusal is logged (nobody waits for an answer)."""
        try:
            await self.reload()
        except (ConfigError, MembershipConflict) as exc:
            log.error("reload (SIGHUP) refused, nothing changed: %s", exc)

    def _reconfigure(self, config: Config) -> None:
        if self._tls is not None and config.tls.enabled:
            tls_load(self._tls, config.tls)  # a rotated certificate, for new connections
        self.config = config
        self.membership.model = config.model
        self.dataplane.reconfigure(config)
        self.flow.reconfigure(config)
        self.flow_gate.reconfigure(config)
        self.fleet.policy = Policy.of(config.recovery)
        for part in (self.health, self.suspects, self.prober, self.readmission, self.small):
            part.reconfigure(config)
        if self.supervisor is not None:
            self.supervisor.reconfigure(config)

    def _publish_loads(self, loads: dict[str, EngineLoad]) -> None:
        """Scraped engine loads to this process's placement and every worker's."""
        self.dataplane.prefix.set_loads(loads)
        self._loads = loads
        self.flow.handle(Tick())  # an engine's queue may have emptied
        if self.supervisor is not None:
            self.supervisor.send_loads(loads)

    def move_streams(self, engine_id: str) -> None:
        """Migrate the streams decoding on `engine_id` now, in every data plane (planned
        maintenance with `migrate`)."""
        if self.supervisor is not None:
            self.supervisor.move_streams(engine_id)
        else:
            self.dataplane.move_streams(engine_id)

    def data_pool_usage(self) -> tuple[int, int]:
        """Data connections in use and requests waiting for one, over every data plane."""
        if self.supervisor is not None:
            return self.supervisor.pool_usage()
        return self.dataplane.pool.in_use, self.dataplane.pool.waiting

    def _lease_json(self) -> dict[str, Any] | None:
        return self.ownership.keeper.handoff_lease() if self.ownership else None

    def is_active(self) -> bool:
        """Runs monitor passes: always without a lease, else only while holding it."""
        return self.ownership is None or self.ownership.keeper.role is LeaseRole.ACTIVE

    def ready(self) -> str | None:
        reason = fleet_ready_reason(
            self.admission.reason("lease"),
            self.admission.reason("monitor"),
            self.fleet,
            self.clock.monotonic(),
        )
        self.metrics.ready.set(0 if reason else 1)
        return reason

    def _wall_of(self, monotonic_s: float | None) -> float | None:
        """A monotonic moment as wall-clock seconds, for the admin API (None stays None).

        Uses the clocks' offset taken at start, so the same moment always reads the same."""
        if monotonic_s is None:
            return None
        return monotonic_s + self._wall_offset_s

    def admin_snapshot(self) -> admin_views.AdminSnapshot:
        """What the admin documents are made of, taken in one go (`telemetry/admin_views`)."""
        now = self.clock.monotonic()
        return admin_views.AdminSnapshot(
            router_id=self.config.effective_router_id,
            ready=self.ready(),
            mono=now,
            wall=self.clock.wall(),
            engines=self._engine_rows(now),
            stats=self.stats_snapshot(),
            monitor=self.monitor.to_json(),
            lease=self.ownership.to_json() if self.ownership is not None else None,
            timeline=tuple(sample.to_json() for sample in self.timeline.samples),
            placement=self._placement_snapshot(),
            flow=self.flow_snapshot(),
        )

    def flow_snapshot(self) -> admin_views.FlowSnapshot:
        """Flow control's queue and refusals (`/admin/flow`, DESIGN §13)."""
        flow, config = self.flow, self.config
        waiting = tuple((e.priority, e.enqueued_at) for e in flow.state.queue)
        resuming = flow.state.preemptions.waiting()
        return admin_views.FlowSnapshot(
            enabled=config.flow_on,
            rate_limits=any(
                p.requests_per_minute or p.tokens_per_minute
                for p in config.auth.key_policies.values()
            ),
            queue_limit=flow.state.queue.limit,
            max_wait_s=config.flow.max_wait_s,
            mono=self.clock.monotonic(),
            waiting=waiting,
            running=len(flow.state) - len(waiting) - resuming,
            refused=dict(flow.refused),
            refused_by_key={k: dict(v) for k, v in flow.refused_by_key.items()},
            served_tokens=dict(flow.served_tokens),
            resuming=resuming,
            preempted=dict(flow.preempted),
        )

    def stats_snapshot(self) -> admin_views.StatsSnapshot:
        """The interval windows and the small-fleet stages' findings (`/admin/stats`)."""
        small = self.small
        return admin_views.StatsSnapshot(
            interval_s=self.config.controller.interval_s,
            current=self.stats.current,
            closed=tuple(self.stats.closed),
            windows_kept=self.stats.closed.maxlen,
            drift=tuple((d.engine_id, d.reason) for d in small.drift),
            drift_mode=self.config.controller.drift_mode,
            risk=small.risk,
            rebalances=tuple(small.rebalances),
        )

    def _placement_snapshot(self) -> admin_views.PlacementSnapshot:
        """This process's index (every engine's events, and every worker's placements) and
        the prefix counters the data plane keeps."""
        prefix = self.dataplane.prefix
        blocks = (
            {e.id: prefix.index.index_blocks(e.id) for e in self.fleet} if prefix.enabled else {}
        )
        return admin_views.PlacementSnapshot(
            policy=self.config.placement.policy,
            cached_blocks=blocks,
            lookup_tokens=self.metrics.data_totals("narwhal_prefix_lookup_tokens", "model"),
            hit_tokens=self.metrics.data_totals("narwhal_prefix_hit_tokens", "model"),
            engine_lookup_tokens=self.metrics.data_totals(
                "narwhal_prefix_engine_lookup_tokens", "engine"
            ),
            engine_hit_tokens=self.metrics.data_totals(
                "narwhal_prefix_engine_hit_tokens", "engine"
            ),
        )

    def _engine_rows(self, now: float) -> tuple[admin_views.EngineRow, ...]:
        settled, results = self.small.drains_settled, self.readmission.last_results
        return tuple(
            admin_views.EngineRow(
                state=e,
                eligible=self.fleet.eligible(e, now),
                in_flight=self.fleet.in_flight.of(e.id),
                drain_settled_at=self._wall_of(settled.get(e.id)),
                readmission=tuple(r.to_json() for r in results.get(e.id, [])),
            )
            for e in self.fleet
        )

    def engines_json(self) -> list[dict[str, Any]]:
        """`/admin/engines`'s list, as the CLI and the tests read it."""
        now = self.clock.monotonic()
        return [admin_views.engine(row, now) for row in self._engine_rows(now)]

    # ------------------------------------------------------------------ HTTP
    def build_app(self) -> web.Application:
        """The admin surface (`/admin/*`, `/metrics`, the dashboard) on aiohttp."""
        from narwhal.http_errors import openai_http_errors
        from narwhal.http_routes import add_admin_routes

        app = web.Application(
            client_max_size=self.config.serving.max_body_bytes + 1024,
            middlewares=[openai_http_errors],  # outermost: the routes' own middlewares run inside
        )
        add_admin_routes(app, self)
        return app

    def client_connections(self) -> int:
        """Client connections open, over every data plane."""
        if self.supervisor is not None:
            return self.supervisor.table.total(CLIENT_CONNECTIONS)
        return self._connections.count

    def build_server(self, forward: Handler) -> H1Server:
        """The client API (`process/routes.py`) on this process's HTTP/1.1 server, as a
        worker serves it; `forward` takes the rest to the admin surface."""
        serving = self.config.serving
        surface = ClientSurface(
            self.dataplane,
            self.ready,
            lambda: self.fleet.servable_models(self.clock.monotonic()),
            forward,
        )
        rejected = self.metrics.data.client_rejected
        self._connections = LocalConnections(serving.max_client_connections)
        return H1Server(
            client_routes(surface),
            forward,
            limits=client_limits(serving),
            budget=self._connections,
            on_reject=lambda reason: rejected.labels(reason).inc(),
        )

    @contextlib.asynccontextmanager
    async def surfaces(self, host: str, port: int, runtime: Path) -> AsyncIterator[int]:
        """One process's serving (`serving.workers: 1`): the admin app on a Unix socket in
        `runtime`, the client server on (host, port), forwarding to it as a worker does.
        Yields the bound port; on exit, the listener closes and running requests finish
        within `serving.shutdown_grace_s`."""
        runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        server: H1Server | None = None
        forward: ControlForward | None = None
        try:
            socket_path = str(runtime / "control.sock")
            await web.UnixSite(runner, socket_path).start()
            forward = ControlForward(
                socket_path, self.config.admin.resolve_token(), self.config.serving.max_body_bytes
            )
            server = self.build_server(forward)
            await server.start(host, port, self._tls, reuse_port=False)
            yield server.port
        finally:
            if server is not None:
                await server.drain(self.config.serving.shutdown_grace_s)
            if forward is not None:
                await forward.close()
            await runner.cleanup()

    async def run(
        self, host: str, port: int, on_ready: Callable[[int], None] | None = None
    ) -> None:
        """Serve until cancelled."""
        removed = await asyncio.to_thread(remove_stale_temps, self.handoff.path)
        if removed:
            log.info("removed %d stale handoff temporary files", len(removed))
        await self.client.start()
        configured = self.config
        if self.discovery is not None:
            # The configured fleet is the config's engines and the first round's answer.
            await self.discovery.round()
            members = tuple(e.config for e in self.fleet)
            configured = self.config.model_copy(update={"engines": members})
        if self.resume:
            self.resume_verdict = await resume(
                configured, self.handoff, self.fleet, self.clock, self.metrics
            )
        if self.resume_verdict is None or not self.resume_verdict.ok:
            await continue_sequence(self.handoff)  # an applied resume already continued it
        if self.ownership is not None:
            await self.ownership.start(self.standby)
        # Shutdown closes the listener, then lets running requests finish within the grace.
        runner = web.AppRunner(
            self.build_app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.config.serving.shutdown_grace_s,
        )
        runtime = await asyncio.to_thread(_runtime_dir)
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.workers == 1:
                    bound = await stack.enter_async_context(self.surfaces(host, port, runtime))
                    log.info(
                        "serving requests in this process, request ids %s-N", self.request_prefix,
                        extra={"request_prefix": self.request_prefix},
                    )  # fmt: skip
                else:
                    await runner.setup()
                    stack.push_async_callback(runner.cleanup)
                    bound = await self._prepare_workers(runner, runtime, host, port)
                await self._serve(bound, host, on_ready)
        finally:
            if self._owns_spawner and self._spawner is not None:
                await self._spawner.aclose()  # after the workers: they die with it
                self._spawner = None
            await self.client.close()
            await self.dataplane.close()
            await asyncio.to_thread(shutil.rmtree, runtime, True)

    async def _serve(self, bound: int, host: str, on_ready: Callable[[int], None] | None) -> None:
        """The background work, until cancelled; then the workers stop and the lease goes
        (the caller then closes the listener and lets running requests finish)."""
        try:
            log.info("narwhal listening on http://%s:%s", host, bound)
            async with asyncio.TaskGroup() as tg:
                self._tasks = tg
                # This process's own loop: the lease, the monitor and the handoff run on it
                # (with `workers: 1`, every request too: exported under both names).
                m = self.metrics
                if self.workers == 1:
                    lag = Observers(m.loop_lag, m.control_loop_lag)
                    stall = Observers(m.loop_stall, m.control_loop_stall)
                else:
                    lag, stall = Observers(m.control_loop_lag), Observers(m.control_loop_stall)
                tg.create_task(watch_loop_lag(lag, stall))
                # Cache-aware placement's index: followed here in every mode (a standby's is
                # warm at takeover; with workers it explains decisions for /admin).
                interval_s = self.config.placement.metrics_interval_s
                tg.create_task(self.dataplane.prefix.run(lambda: self.fleet, interval_s))
                # The engines' own load: placement's ranking, and flow control's saturation
                # (which a reload may turn on or off).
                scraper = LoadScraper(
                    lambda: self.fleet,
                    self.client,
                    self.clock,
                    interval_s,
                    self.config.engine.health_timeout_s,
                    self._publish_loads,
                    wanted=lambda: self.dataplane.prefix.enabled or self.config.flow_on,
                )
                tg.create_task(scraper.run())
                tg.create_task(self.flow.run())
                if self.config_path is not None:
                    asyncio.get_running_loop().add_signal_handler(
                        signal.SIGHUP, lambda: tg.create_task(self._reload_on_signal())
                    )
                    watch_s = self.config.controller.config_watch_interval_s
                    if watch_s is not None:  # a ConfigMap mount: no SIGHUP comes
                        path, clock = self.config_path, self.clock
                        tg.create_task(config_watch.watch(path, watch_s, clock, self.reload))
                if self.ownership is not None:
                    tg.create_task(self.ownership.run())
                if self.etcd_status is not None:
                    tg.create_task(self.etcd_status.run())
                if self.discovery is not None:
                    tg.create_task(self.discovery.run())
                if self.is_active():
                    # Right after binding (a port in use fails before any engine is asked),
                    # before `on_ready` and the first pass, within engine.health_timeout_s:
                    # until it ends /ready says `starting`, never routing to an unverified
                    # engine (docs/monitor.md#engine-verification).
                    await self.health.startup_sweep(self.clock.monotonic())
                if self.supervisor is not None:
                    # The workers listen once the sweep is done, so their first snapshot
                    # holds the engines it verified (the port was reserved before it).
                    await self.supervisor.start()
                    tg.create_task(self.supervisor.run())
                if on_ready is not None:
                    on_ready(bound)
                tg.create_task(
                    self.monitor.run_forever(
                        self.config.controller.monitor_interval_s, should_run=self.is_active
                    )
                )
        finally:
            self._tasks = None
            # Requests still waiting to start are answered now (their clients retry
            # elsewhere); running ones finish within the grace.
            self.flow.fence("shutting down")
            self.flow_gate.close("not_admitted", "not admitting requests: shutting down", True)
            if self.config_path is not None:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            if self.supervisor is not None:
                await self.supervisor.stop(self.config.serving.shutdown_grace_s)
                # The workers are gone: back to this process's own counts, table released.
                self.fleet.in_flight = InFlight(e.id for e in self.fleet)
                self.supervisor.table.close()
                self.supervisor = None
                self.flow.deliver = self.flow_gate.answer
            if self.ownership is not None:
                await self.ownership.keeper.release()
                await self.ownership.keeper.store.close()

    async def _prepare_workers(
        self, runner: web.AppRunner, runtime: Path, host: str, port: int
    ) -> int:
        """Reserve the port, serve the admin surface on a Unix socket for the workers to
        forward to, and render their metrics with ours; `run` starts them. In-flight counts
        are then the sums of the workers' rows of a shared table; this process only reads."""
        table = WorkerTable.create(self.workers)
        in_flight = SharedInFlight(table, None)
        for engine in self.fleet:
            in_flight.add(engine.id)
        self.fleet.in_flight = in_flight
        if self._spawner is None:
            self._spawner = WorkerSpawner()
        self._spawner.start()  # imports while the startup sweep runs
        sup = self.supervisor = Supervisor(
            self.config,
            self.workers,
            table,
            in_flight,
            self.fleet,
            self.admission,
            lambda: self.ownership.keeper.admission_window() if self.ownership else None,
            self.evidence,
            self.stats,
            self.timeline,
            self.metrics,
            self.clock,
            runtime,
            self.events.add,
            self._spawner,
            placed=self.dataplane.prefix.placed_elsewhere,
            flow=self.flow,
        )
        if self.ownership is not None:
            self.ownership.keeper.on_window = sup.send_gate
        bound = sup.reserve(host, port)
        await web.UnixSite(runner, sup.control_socket).start()
        sup.metrics_dir.mkdir()
        shared = CollectorRegistry(auto_describe=True)
        shared.register(SummedData(self.metrics.data.registry, WorkerFiles(sup.metrics_dir)))
        self.metrics.render_data = lambda: generate_latest(shared)
        self.metrics.add_worker_metrics()
        running = self.metrics.workers_running
        running.labels("running").set_function(lambda: sum(w.running for w in sup.workers))
        running.labels("restarting").set_function(lambda: sum(not w.running for w in sup.workers))
        return bound


def _runtime_dir() -> Path:
    """A private directory for this run's control socket and the workers' metric files;
    ones left by a killed control process are removed first."""
    base = Path(tempfile.gettempdir())
    for stale in sweep_stale_runtime_dirs(base):
        log.info("removed stale runtime directory %s", stale)
    return Path(tempfile.mkdtemp(prefix=f"narwhal-{os.getpid()}-"))
