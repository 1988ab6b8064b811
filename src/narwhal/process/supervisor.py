"""The control process's side of its data-plane workers (DESIGN §9).

It reserves the port, starts N worker processes (`worker.py`) that each listen on it with
`SO_REUSEPORT`, and talks to each over its own socket pair:
- out: the fleet snapshot (the engines that changed, at most once per loop turn), the
  admission gate, and a heartbeat that keeps the gate valid;
- in: leg outcomes, applied through the `EvidenceRecorder` (so the reducer decides, and a
  failure in one worker pauses the engine for all), and stats deltas.

A worker that exits is restarted after a backoff; the requests it was serving are counted
as lost, and nothing is charged to an engine. Stopping drains: every worker stops accepting
and finishes its requests within the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from narwhal.clock import Clock
from narwhal.config import Config
from narwhal.control.evidence import EvidenceRecorder
from narwhal.control.flow import FlowService
from narwhal.dataplane.prefix import Shared
from narwhal.dataplane.request_ids import request_prefix
from narwhal.fleet.admission import Admission
from narwhal.fleet.codec import encode
from narwhal.fleet.intervals import IntervalStats
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet
from narwhal.flow.messages import Ask, Begun, Done, FlowEffect, Kept, Requeue, Withdraw, WorkerLost
from narwhal.placement.load import EngineLoad
from narwhal.process.channel import Channel, Frame
from narwhal.process.events import (
    FrameError,
    LegFailed,
    LegSucceeded,
    Noted,
    Placed,
    Ready,
    Seen,
    Stats,
    decode,
    encode_answer,
)
from narwhal.process.gate import GateData
from narwhal.process.spawner import SpawnedWorker, WorkerSpawner
from narwhal.process.table import (
    CHAT,
    COMPLETIONS,
    POOL_IN_USE,
    POOL_WAITING,
    SharedInFlight,
    WorkerTable,
)
from narwhal.state.lease import AdmissionWindow
from narwhal.telemetry.events import Note
from narwhal.telemetry.metrics import Metrics
from narwhal.telemetry.timeline import Timeline

log = logging.getLogger("narwhal.workers")

READY_TIMEOUT_S = 30.0
_JSON_FORMATTER = "JsonFormatter"


CONTROL_WINDOW_MIN_S = 2.0
"""The least a worker trusts the control process's last word. A dead control process is seen
at once (the channel's end); this covers only one that is alive and silent, and on a loaded
host (a container's CPU quota throttling it, GC, a busy scheduler) that lasts longer than one
might think: with a floor of 0.5 s, workers refused requests as `control process lost` from
a control process that was merely slow, on a 2-core host running the test suite. Fencing does
not rest on it (the lease's window is judged on the worker's own clock)."""


def control_window_s(config: Config) -> float:
    """How long a worker trusts the control process's last word: one monitor interval, at
    least `CONTROL_WINDOW_MIN_S`."""
    return max(config.controller.monitor_interval_s, CONTROL_WINDOW_MIN_S)


def restart_delay_s(recent_exits: int) -> float:
    """Backoff before restarting a worker that exited `recent_exits` times in a row: 0,
    then 0.5 s, doubling up to 10 s."""
    if recent_exits <= 1:
        return 0.0
    return min(10.0, 0.5 * 2.0 ** min(recent_exits - 2, 5))


def shares(total: int, n: int) -> list[int]:
    """`total` split over `n` workers, the remainder to the first ones."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


@dataclass(slots=True)
class WorkerInfo:
    index: int
    pid: int | None = None
    started_at: float | None = None
    restarts: int = 0
    recent_exits: int = 0
    last_exit: str | None = None
    seen_version: int = 0
    channel: Channel | None = None
    ready: asyncio.Future[int] | None = None
    generation: int = 0
    running: bool = False
    acks: list[int] = field(default_factory=list)
    request_prefix: str = ""  # its request ids are `<prefix>-N`: which process placed a leg

    def to_json(self, table: WorkerTable) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": self.pid,
            "running": self.running,
            "started_at": self.started_at,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "snapshot_version": self.seen_version,
            "request_prefix": self.request_prefix,
            "requests_in_progress": table.get(self.index, COMPLETIONS)
            + table.get(self.index, CHAT),
        }


class Supervisor:
    def __init__(
        self,
        config: Config,
        count: int,
        table: WorkerTable,
        in_flight: SharedInFlight,
        fleet: Fleet,
        admission: Admission,
        lease_window: Callable[[], AdmissionWindow | None],
        evidence: EvidenceRecorder,
        stats: IntervalStats,
        timeline: Timeline,
        metrics: Metrics,
        clock: Clock,
        runtime_dir: Path,
        note: Note,
        spawner: WorkerSpawner,
        placed: Shared | None = None,
        flow: FlowService | None = None,
    ) -> None:
        """`note` puts what workers report (migrations) on the event timeline; `placed` is
        the control process's own index, told of every worker's placement as the other
        workers are (cache-aware placement's speculative entries, DESIGN §11)."""
        self._config = config
        self._note = note
        self._spawner = spawner
        self._placed = placed
        self._flow = flow
        if flow is not None:
            flow.deliver = self.deliver
        self.count = count
        self.table = table
        self._in_flight = in_flight
        self._fleet = fleet
        self._admission = admission
        self._lease_window = lease_window
        self._evidence = evidence
        self._stats = stats
        self._timeline = timeline
        self._metrics = metrics
        self._clock = clock
        self.runtime_dir = runtime_dir
        self.control_socket = str(runtime_dir / "control.sock")
        self.metrics_dir = runtime_dir / "metrics"
        self.workers = [WorkerInfo(i) for i in range(count)]
        self._queue_shares = shares(config.serving.queue_limit, count)
        self.version = 0
        self._dirty: set[str] = set()
        self._configured: set[str] = set()  # members whose config the workers need anew
        self._gone: set[str] = set()  # members forgotten since the last snapshot
        self._scheduled = False
        self._stopping = False
        self._window_s = control_window_s(config)
        self._reservation: socket.socket | None = None
        self._host = ""
        self.port = 0
        self._procs: dict[int, SpawnedWorker] = {}
        fleet.observe(self._on_fleet_change)
        fleet.observe_membership(self._on_membership)
        admission.on_change(self._schedule)

    # ---------------------------------------------------------------- start and run
    def reserve(self, host: str, port: int) -> int:
        """Bind the port without listening: it resolves port 0, fails fast when another
        process holds the port, and keeps it while workers restart. A bound socket that is
        not listening never receives connections."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
        except socket.gaierror:
            sock.close()
            raise  # the caller names the unresolvable host
        except OSError as exc:
            sock.close()
            raise OSError(f"listen {host}:{port}: {(exc.strerror or str(exc)).lower()}") from None
        self._reservation = sock
        self._host = host
        self.port = sock.getsockname()[1]
        if port != 0 and _someone_listens(host, self.port):
            sock.close()
            raise OSError(f"listen {host}:{port}: another SO_REUSEPORT listener serves this port")
        return self.port

    async def start(self) -> None:
        """Start every worker; return once all listen (a worker that fails to start fails
        the router's start). Heartbeats go on meanwhile: a worker that listens first serves
        while a slower one starts, and must not take this process for lost."""
        self.metrics_dir.mkdir(exist_ok=True)
        beats = asyncio.create_task(self._heartbeats())
        try:
            await asyncio.gather(*(self._spawn(w) for w in self.workers))
        finally:
            beats.cancel()

    async def run(self) -> None:
        """Heartbeats and restarts, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            for w in self.workers:
                tg.create_task(self._watch(w))
            await self._heartbeats()

    async def _heartbeats(self) -> None:
        """Keep the workers' gate valid, and current, until cancelled."""
        while True:
            self.send_gate()
            await self._clock.sleep(self._window_s / 4)

    async def stop(self, grace_s: float) -> None:
        """Drain: each worker stops accepting and finishes its requests within `grace_s`;
        a worker still running after that (plus 2 s) is killed."""
        self._stopping = True
        for w in self.workers:
            if w.channel is not None:
                w.channel.send("drain", grace_s=grace_s)
                w.channel.flush()
        procs = list(self._procs.values())
        if procs:
            # Heartbeats go on while the workers drain: their `/ready` says `draining`, not
            # `control process lost` (this process is alive, only `run` has ended).
            async with asyncio.TaskGroup() as tg:
                beats = tg.create_task(self._heartbeats())
                _, pending = await asyncio.wait(
                    [asyncio.ensure_future(p.wait()) for p in procs], timeout=grace_s + 2.0
                )
                beats.cancel()
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            for task in pending:
                with contextlib.suppress(ProcessLookupError):
                    await task
        for w in self.workers:
            if w.channel is not None:
                w.channel.close()
        if self._reservation is not None:
            self._reservation.close()

    async def _spawn(self, w: WorkerInfo) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        w.generation += 1
        w.request_prefix = request_prefix()
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        try:
            proc = await self._spawner.spawn(w.index, child, self.table.fd, env)
        except OSError:
            parent.close()
            raise
        finally:
            child.close()
        self._procs[w.index] = proc
        w.pid = proc.pid
        w.started_at = self._clock.wall()
        w.ready = asyncio.get_running_loop().create_future()
        channel = w.channel = await Channel.open(
            parent, lambda f: self._on_frame(w, f), lambda: self._on_lost(w)
        )
        channel.send("hello", **self._hello(w))
        self._send_snapshot(channel, list(self._fleet), full=True)
        channel.flush()
        waiter = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait(
                {w.ready, waiter}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if not waiter.done():
                waiter.cancel()
        if w.ready not in done:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            channel.close()
            raise OSError(f"data-plane worker {w.index} failed to start")
        w.running = True
        log.info(
            "worker %d started (pid %d), request ids %s-N", w.index, proc.pid, w.request_prefix,
            extra={"worker": w.index, "request_prefix": w.request_prefix},
        )  # fmt: skip

    def _hello(self, w: WorkerInfo) -> dict[str, Any]:
        root = logging.getLogger()
        json_logs = any(type(h.formatter).__name__ == _JSON_FORMATTER for h in root.handlers)
        return {
            "config": self._config.model_dump(mode="json"),
            "rows": self.count,
            "queue_limit": self._queue_shares[w.index],
            "control_socket": self.control_socket,
            "grace_s": self._config.serving.shutdown_grace_s,
            "settle_s": self._window_s,
            "log": [logging.getLevelName(root.level).lower(), "json" if json_logs else "text"],
            "metrics_id": f"w{w.index}-{os.getpid()}-{w.generation}",
            "request_prefix": w.request_prefix,
            "host": self._host,
            "port": self.port,
        }

    async def _watch(self, w: WorkerInfo) -> None:
        """Restart `w` whenever it exits, until the router stops."""
        while True:
            proc = self._procs[w.index]
            status = await proc.wait()
            w.running = False
            reason = _exit_reason(status)
            w.last_exit = reason
            if self._stopping:
                return
            lost = {
                "completions": self.table.get(w.index, COMPLETIONS),
                "chat": self.table.get(w.index, CHAT),
            }
            for endpoint, n in lost.items():
                if n > 0:
                    self._metrics.worker_lost_requests.labels(endpoint).inc(n)
            self.table.zero(w.index)
            self._worker_lost(w)
            self._metrics.worker_exits.labels(_exit_kind(status)).inc()
            log.warning(
                "worker %d (pid %s) exited (%s) with %d requests in progress; restarting",
                w.index,
                w.pid,
                reason,
                sum(lost.values()),
            )
            w.recent_exits = w.recent_exits + 1 if _ran_briefly(w, self._clock) else 1
            while True:  # until a replacement listens; a failed start backs off further
                await self._clock.sleep(restart_delay_s(w.recent_exits))
                try:
                    await self._spawn(w)
                    break
                except OSError as exc:
                    log.error("worker %d: restart failed: %s", w.index, exc)
                    w.recent_exits += 1
            w.restarts += 1
            self._metrics.worker_restarts.inc()

    # ---------------------------------------------------------------- frames in
    def _on_frame(self, w: WorkerInfo, frame: Frame) -> None:
        try:
            event = decode(frame)
        except FrameError as exc:
            log.error("worker %d sent a malformed frame: %s", w.index, exc)
            return
        match event:
            case LegFailed() | LegSucceeded():
                self._apply_event(w, event)
            case Stats(engines=engines, timeline=timeline):
                for engine_id, (requests, latency, inter_token) in engines.items():
                    self._stats.merge(engine_id, requests, latency, inter_token)
                self._timeline.merge(*timeline)
            case Seen(version=version):
                w.seen_version = version
            case Noted(event=kind, engine=engine_id, what=what):
                self._note(kind, engine_id, what)
            case Placed():
                self._share_placement(w, event)
            case Ask():
                if self._flow is not None:  # the worker is the channel's, whatever it says
                    self._flow.handle(replace(event, worker=w.index))
            case Begun() | Done() | Withdraw() | Requeue() | Kept():
                if self._flow is not None:
                    self._flow.handle(event)
            case Ready(pid=pid):
                if w.ready is not None and not w.ready.done():
                    w.ready.set_result(pid)
                if w.channel is not None:  # its spawn-time gate may have run out meanwhile
                    w.channel.send("gate", gate=self._gate().to_json())

    def send_loads(self, loads: Mapping[str, EngineLoad]) -> None:
        """The engines' scraped loads (placement), to every worker."""
        wire = {
            k: [v.waiting, v.running, v.kv_usage, v.at, v.capacity_tokens] for k, v in loads.items()
        }
        for w in self.workers:
            if w.channel is not None:
                w.channel.send("loads", loads=wire)

    def _share_placement(self, w: WorkerInfo, placed: Placed) -> None:
        """A worker placed a prefill with these block keys: every other worker (and this
        process's index) holds them as speculative too, so one new prefix is not sent to two
        engines by two workers before the engine's events arrive."""
        for other in self.workers:
            if other is not w and other.channel is not None:
                other.channel.send(
                    "placed", model=placed.model, engine=placed.engine, keys=placed.keys
                )
        if self._placed is not None:
            self._placed(placed.model, placed.engine, placed.keys)

    def _apply_event(self, w: WorkerInfo, event: LegFailed | LegSucceeded) -> None:
        if isinstance(event, LegFailed):
            self._evidence.failure(event.engine, event.failure(), event.leg)
        else:
            self._evidence.success(event.engine, event.success, event.leg)
        # After this turn's snapshot went out (it is written at once): a worker that learns
        # its failure was applied knows every other worker has the result in its socket.
        if not w.acks:
            asyncio.get_running_loop().call_soon(self._ack, w)
        w.acks.append(event.seq)

    def _ack(self, w: WorkerInfo) -> None:
        if w.acks and w.channel is not None:
            w.channel.send("ack", upto=max(w.acks))
        w.acks.clear()

    def _on_lost(self, w: WorkerInfo) -> None:
        w.channel = None

    def _worker_lost(self, w: WorkerInfo) -> None:
        """Its requests waiting to start, and its grants, go: nothing is started for a dead
        client and no slot is held for it. Called once its process exited, before its
        replacement starts (whose asks must not be taken for the dead one's)."""
        if self._flow is not None:
            self._flow.handle(WorkerLost(w.index))

    def deliver(self, effect: FlowEffect) -> None:
        """Flow control's answer, to the worker that asked."""
        w = self.workers[effect.worker] if 0 <= effect.worker < len(self.workers) else None
        if w is not None and w.channel is not None:
            kind, fields = encode_answer(effect)
            w.channel.send(kind, **fields)

    # ---------------------------------------------------------------- frames out
    def _on_fleet_change(self, before: EngineState, after: EngineState, *_: Any) -> None:
        self._dirty.add(after.id)
        if after.config is not before.config:  # relocated
            self._configured.add(after.id)
        self._schedule()

    def _on_membership(self, engine_id: str, present: bool) -> None:
        """A member joined (the workers need its config and column) or was forgotten."""
        if present:
            self._gone.discard(engine_id)
            self._dirty.add(engine_id)
            self._configured.add(engine_id)
        else:
            self._gone.add(engine_id)
            self._dirty.discard(engine_id)
            self._configured.discard(engine_id)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and not self._stopping:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._broadcast)

    def publish_now(self) -> None:
        """Write this turn's pending snapshot at once: an operator's change is in every
        worker's socket before the operator is answered."""
        if self._scheduled:
            self._broadcast()

    def reconfigure(self, config: Config) -> None:
        """A reloaded config to every worker (and to the ones started later)."""
        self._config = config
        for w in self.workers:
            if w.channel is not None:
                w.channel.send("config", config=config.model_dump(mode="json"))

    def move_streams(self, engine_id: str) -> None:
        """Every worker migrates its streams decoding on `engine_id`. Sent after the engine's
        hold (`publish_now`), in the same ordered channel, so a moved stream's next pair
        avoids it."""
        for w in self.workers:
            if w.channel is not None:
                w.channel.send("move", engine=engine_id)

    def _broadcast(self) -> None:
        """The engines that changed this turn, and the gate, to every worker, written now."""
        if not self._scheduled:
            return  # published early by `publish_now`
        self._scheduled = False
        changed = [self._fleet.get(e) for e in sorted(self._dirty) if self._fleet.has(e)]
        gone = sorted(self._gone)
        configured = set(self._configured)
        self._dirty.clear()
        self._gone.clear()
        self._configured.clear()
        self.version += 1
        for w in self.workers:
            if w.channel is not None:
                self._send_snapshot(w.channel, changed, configured=configured, gone=gone)
                w.channel.flush()

    def _send_snapshot(
        self,
        channel: Channel,
        engines: list[EngineState],
        *,
        full: bool = False,
        configured: set[str] | frozenset[str] = frozenset(),
        gone: list[str] | None = None,
    ) -> None:
        """Engine states; with each engine that is new to the workers (all of them in a
        `full` snapshot, which also says that unnamed engines are gone), its config and its
        in-flight column."""
        records = []
        columns = self._in_flight.columns
        for e in engines:
            record = encode(e)
            if full or e.id in configured:
                record["config"] = e.config.model_dump(mode="json")
                record["column"] = columns[e.id]
            records.append(record)
        channel.send(
            "snap",
            version=self.version,
            engines=records,
            gone=gone or [],
            full=full,
            gate=self._gate().to_json(),
        )

    def send_gate(self) -> None:
        """The gate to every worker now (a heartbeat, or the lease's window changed)."""
        gate = self._gate().to_json()
        for w in self.workers:
            if w.channel is not None:
                w.channel.send("gate", gate=gate)

    def _gate(self) -> GateData:
        return GateData(
            self._lease_window(),
            self._admission.reason("monitor"),
            self._clock.monotonic() + self._window_s,
        )

    # ---------------------------------------------------------------- views
    def pool_usage(self) -> tuple[int, int]:
        return self.table.total(POOL_IN_USE), self.table.total(POOL_WAITING)

    def to_json(self) -> list[dict[str, Any]]:
        return [w.to_json(self.table) for w in self.workers]


def _someone_listens(host: str, port: int) -> bool:
    """Whether a process already listens on the port: another router using `SO_REUSEPORT`
    (a stale one) would otherwise silently share our clients. Loopback-fast."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _exit_kind(status: int) -> str:
    """The metric's bounded label: signal, error or clean."""
    return "signal" if status < 0 else "error" if status else "clean"


def _exit_reason(status: int) -> str:
    if status < 0:
        try:
            return signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
    return f"exit {status}"


def _ran_briefly(w: WorkerInfo, clock: Clock) -> bool:
    """Whether `w` exited within a minute of starting (a crash loop backs off)."""
    return w.started_at is not None and clock.wall() - w.started_at < 60.0


def sweep_stale_runtime_dirs(base: Path) -> list[Path]:
    """Runtime directories `narwhal-<pid>-*` left by a control process that was killed."""
    removed = []
    for path in base.glob("narwhal-*-*"):
        try:
            pid = int(path.name.split("-")[1])
            os.kill(pid, 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except (IndexError, ValueError, OverflowError, PermissionError):
            continue  # not ours, or not a pid
        _remove_tree(path)
        removed.append(path)
    return removed


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
