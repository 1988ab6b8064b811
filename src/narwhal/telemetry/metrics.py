"""All of a router's Prometheus metrics, in a registry owned by that router (no globals).

Names and labels are a contract documented in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from narwhal.telemetry.loop_lag import LAG_BUCKETS_S

M = TypeVar("M", bound=MetricWrapperBase)

_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Children(Generic[M]):
    """A metric's label children, looked up once: `labels()` validates its arguments and
    takes a lock on every call, which the request path would pay about ten times a request.
    Label sets are never removed from Narwhal's metrics, so a cached child never goes stale."""

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class DataMetrics:
    """What the data plane counts, in its own registry: with workers (DESIGN §9) each worker
    process counts these in prometheus_client's multiprocess files, and the control process
    renders their sum; the rest of `Metrics` lives in the control process only."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "narwhal_requests",
            "Client requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "narwhal_time_to_first_token_seconds",
            "Time from request arrival to first token",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.inter_token = Histogram(
            "narwhal_inter_token_seconds",
            "Time between streamed chunks",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.total_latency = Histogram(
            "narwhal_request_duration_seconds",
            "Total request latency",
            ["endpoint"],
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.leg_outcomes = Counter(
            "narwhal_leg_outcomes",
            "Engine leg outcomes: a failure class or a success kind",
            ["engine", "leg", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "narwhal_retries", "Bounded-policy retries by reason", ["reason"], registry=r
        )
        self.key_requests = Counter(
            "narwhal_client_key_requests",
            "Client requests that passed authentication, by the key's label (the first 12 hex "
            "digits of its SHA-256; auth on)",
            ["key"],
            registry=r,
        )
        self.migrations = Counter(
            "narwhal_migrations",
            "Streams continued on a fresh pair after their decode failed mid-stream or was "
            "moved off for planned maintenance (cause `maintenance`), by cause and by how they "
            "were continued (token_ids or text)",
            ["cause", "kind"],
            registry=r,
        )
        self.migration_gap = Histogram(
            "narwhal_migration_gap_seconds",
            "The pause a client saw at a migration: its last byte before the failure to the "
            "first byte of the continuation",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.migrated_streams = Counter(
            "narwhal_migrated_streams",
            "Streams that needed a migration, by result: saved (ended normally) or lost",
            ["result"],
            registry=r,
        )
        self.token_checks = Counter(
            "narwhal_token_checks",
            "Prompt-length checks by how they were decided",
            ["result"],
            registry=r,
        )
        self.prefix_lookup_tokens = Counter(
            "narwhal_prefix_lookup_tokens",
            "Prompt tokens placed by cache-aware placement (policy prefix), by model",
            ["model"],
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "narwhal_prefix_hit_tokens",
            "Prompt tokens found cached on the prefill engine chosen, by model",
            ["model"],
            registry=r,
        )
        self.prefix_engine_lookup_tokens = Counter(
            "narwhal_prefix_engine_lookup_tokens",
            "Prompt tokens placed on each prefill engine by cache-aware placement",
            ["engine"],
            registry=r,
        )
        self.prefix_engine_hit_tokens = Counter(
            "narwhal_prefix_engine_hit_tokens",
            "Prompt tokens found cached on each prefill engine when it was chosen",
            ["engine"],
            registry=r,
        )
        self.client_rejected = Counter(
            "narwhal_client_rejected",
            "Client connections and requests refused at the edge, by reason (header_timeout, "
            "body_timeout, header_too_large, body_too_large, malformed, connections, send_timeout)",
            ["reason"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "narwhal_event_loop_lag_seconds",
            "How late the router's event loop ran a due wake-up (a stall delays everything)",
            registry=r,
            buckets=LAG_BUCKETS_S,
        )
        self.loop_stall = Histogram(
            "narwhal_event_loop_stall_seconds",
            "How late the router's event loop ran a due wake-up, less the time its thread "
            "waited for a CPU: the router's own stalls, without a starved host's",
            registry=r,
            buckets=LAG_BUCKETS_S,
        )


class WorkerFiles:
    """The workers' multiprocess files, summed as prometheus_client's `MultiProcessCollector`
    sums them, but for a file a worker has only just created: it is empty until the worker
    sizes it, and reading it then raises `struct.error` (a starting worker turned a scrape,
    and `GET /admin/engines` with it, into a 500). Such a file holds no value yet."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def collect(self) -> Iterable[Metric]:
        files = [str(f) for f in self._path.glob("*.db") if _sized(f)]
        merged: Iterable[Metric] = MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
        return merged


def _sized(file: Path) -> bool:
    """Past its header (the used-bytes count a reader unpacks first)."""
    try:
        return file.stat().st_size >= 8
    except FileNotFoundError:
        return False


class SummedData:
    """The data plane's families as the workers counted them (their multiprocess files,
    summed), under this process's own names and help; a family no worker has touched yet
    is exported empty, as one process would."""

    def __init__(self, local: CollectorRegistry, workers: Collector) -> None:
        self._local = local
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        summed = {m.name: m for m in self._workers.collect()}
        for family in self._local.collect():
            found = summed.get(family.name)
            if found is None:
                yield family
                continue
            out = Metric(family.name, family.documentation, family.type)
            out.samples = found.samples
            yield out


SHED_REASONS = ("queue_full", "deadline", "requests_per_minute", "tokens_per_minute")


class FlowMetrics:
    """Flow control's (DESIGN §13): counted where its one queue is, the control process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.queue_depth = Gauge(
            "narwhal_queue_depth",
            "Requests waiting in flow control's queue to start, by priority",
            ["priority"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "narwhal_queue_wait_seconds",
            "Time a request waited in flow control's queue, by priority (at its start, or "
            "its refusal)",
            ["priority"],
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.shed = Counter(
            "narwhal_shed",
            "Requests refused 429 by flow control, by reason (queue_full, deadline, "
            "requests_per_minute, tokens_per_minute)",
            ["reason"],
            registry=r,
        )
        self.client_tokens = Counter(
            "narwhal_client_tokens",
            "Output tokens served, by client key label (auth on)",
            ["key"],
            registry=r,
        )
        self.preemptions = Counter(
            "narwhal_preemptions",
            "Running streams that stepped aside for a more urgent request when flow control "
            "asked, by their priority (flow.preempt_priority)",
            ["priority"],
            registry=r,
        )
        # Exported from the start (a scrape shows 0, not nothing): the default priority, and
        # every reason a request is shed.
        self._depths: set[str] = {"0"}
        self.queue_depth.labels("0").set(0)
        self.queue_wait.labels("0")
        self.preemptions.labels("0")
        for reason in SHED_REASONS:
            self.shed.labels(reason)

    def observe_depth(self, depth: Mapping[int, int]) -> None:
        """The queue's depth by priority; a priority seen once stays, at 0 when empty."""
        for priority, n in depth.items():
            label = str(priority)
            self._depths.add(label)
            self.queue_depth.labels(label).set(n)
        for label in self._depths - {str(p) for p in depth}:
            self.queue_depth.labels(label).set(0)


class Metrics:
    """The control process's metrics, plus the data plane's (`data`): `render` is the whole
    `/metrics` page. `render_data` replaces how the data plane's part is rendered (the
    workers' multiprocess files)."""

    def __init__(self, data: DataMetrics | None = None) -> None:
        self.data = data or DataMetrics()
        d = self.data
        self.requests = d.requests
        self.ttft = d.ttft
        self.inter_token = d.inter_token
        self.total_latency = d.total_latency
        self.leg_outcomes = d.leg_outcomes
        self.retries = d.retries
        self.token_checks = d.token_checks
        self.loop_lag = d.loop_lag
        self.loop_stall = d.loop_stall
        self.render_data: Callable[[], bytes] = lambda: generate_latest(self.data.registry)
        r = self.registry = CollectorRegistry(auto_describe=True)
        # The standard collectors: this process's CPU, memory, file descriptors and start
        # time (`process_*`), and the Python platform (`python_info`). With data-plane
        # workers these describe the control process only.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.flow = FlowMetrics(r)
        self.failures = Counter(
            "narwhal_engine_failures",
            "Engine failures by engine and class",
            ["engine", "failure_class"],
            registry=r,
        )
        self.pool_in_use = Gauge(
            "narwhal_pool_connections_in_use",
            "Connections in use by pool (data, control), read at scrape time",
            ["pool"],
            registry=r,
        )
        self.pool_limit = Gauge(
            "narwhal_pool_connections_limit", "Pool bounds", ["pool"], registry=r
        )
        self.pool_waiting = Gauge(
            "narwhal_pool_waiting", "Requests waiting for a data connection", registry=r
        )
        self.client_connections = Gauge(
            "narwhal_client_connections",
            "Client connections open, all workers together, read at scrape time",
            registry=r,
        )
        self.in_flight = Gauge(
            "narwhal_engine_in_flight", "Requests in flight per engine", ["engine"], registry=r
        )
        self.transitions = Counter(
            "narwhal_engine_transitions",
            "Engine state transitions (`to`: in-service, held, ejected, unverified)",
            ["engine", "to"],
            registry=r,
        )
        self.ejections = Counter(
            "narwhal_ejections", "Ejections by engine and cause", ["engine", "cause"], registry=r
        )
        self.discovery_rounds = Counter(
            "narwhal_discovery_rounds",
            "Discovery rounds by source (dns, file) and result: ok, or failed (a DNS timeout or "
            "server failure, an unreadable or invalid file; nothing changed)",
            ["source", "result"],
            registry=r,
        )
        self.discovered_engines = Gauge(
            "narwhal_discovered_engines",
            "Engines the last successful discovery round of a source found",
            ["source"],
            registry=r,
        )
        self.reloads = Counter(
            "narwhal_reloads",
            "Config reloads by result: ok (applied), refused (the file does not validate, or "
            "its engine set conflicts; nothing changed)",
            ["result"],
            registry=r,
        )
        self.engine_model = Gauge(
            "narwhal_engine_model_info",
            "1 for each engine and the model it serves: join it on `engine` to see any "
            "per-engine metric by model",
            ["engine", "model"],
            registry=r,
        )
        self.membership_changes = Counter(
            "narwhal_membership_changes",
            "Fleet membership changes by change (added, removing, removed, relocated) and "
            "source (operator, reload, dns, file, handoff: a standby following the active)",
            ["change", "source"],
            registry=r,
        )
        self.holds_active = Gauge(
            "narwhal_holds_active",
            "Active holds by engine and name",
            ["engine", "hold"],
            registry=r,
        )
        self.engines_unverified = Gauge(
            "narwhal_engines_unverified",
            "Engines not yet verified (no healthy answer naming the configured model yet; not "
            "eligible), by role (prefill, decode, both, embed), read at scrape time",
            ["role"],
            registry=r,
        )
        self.evidence_streak = Gauge(
            "narwhal_evidence_streak",
            "Current consecutive failure streak by engine and class (every class of every engine, "
            "0 when none; read at scrape time)",
            ["engine", "failure_class"],
            registry=r,
        )
        self.liveness_misses = Gauge(
            "narwhal_liveness_misses", "Consecutive silent health sweeps", ["engine"], registry=r
        )
        self.monitor_stage_errors = Counter(
            "narwhal_monitor_stage_errors",
            "Monitor stage exceptions by stage and class",
            ["stage", "exception"],
            registry=r,
        )
        self.monitor_passes = Counter(
            "narwhal_monitor_passes", "Monitor passes by result", ["result"], registry=r
        )
        self.monitor_failure_streak = Gauge(
            "narwhal_monitor_failure_streak",
            "Consecutive monitor passes with a stage error",
            registry=r,
        )
        self.monitor_stage_seconds = Histogram(
            "narwhal_monitor_stage_seconds",
            "Monitor stage durations",
            ["stage"],
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.admitting = Gauge(
            "narwhal_admitting", "1 when new requests are admitted, else 0", registry=r
        )
        self.ready = Gauge("narwhal_ready", "1 when /ready answers 200", registry=r)
        self.health_checks = Counter(
            "narwhal_health_checks",
            (
                "Health check results: ok, error (HTTP status other than 200), silent (no answer), "
                "busy (no control connection came free: not evidence)"
            ),
            ["engine", "result"],
            registry=r,
        )
        self.probes = Counter(
            "narwhal_probes",
            "Probes by kind and result",
            ["engine", "kind", "result"],
            registry=r,
        )

        self.handoff_resume = Counter(
            "narwhal_handoff_resume", "Resume decisions at start", ["result"], registry=r
        )
        self.handoff_resume_refusals = Counter(
            "narwhal_handoff_resume_refusals",
            "Refused resumes by reason code: missing, unreadable, invalid_json, not_object, "
            "schema_version, schema, checksum, engine_set, impossible",
            ["reason"],
            registry=r,
        )
        self.handoff_writes = Counter(
            "narwhal_handoff_writes", "Handoff writes by result", ["result"], registry=r
        )
        self.handoff_dir_fsync_failures = Counter(
            "narwhal_handoff_dir_fsync_failures",
            "Handoff writes whose directory fsync failed after the rename (accepted)",
            registry=r,
        )
        self.handoff_write_seconds = Histogram(
            "narwhal_handoff_write_seconds",
            "Handoff stage duration",
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )

        self.control_loop_lag = Histogram(
            "narwhal_control_event_loop_lag_seconds",
            "How late the control process's event loop ran a due wake-up (the lease, the "
            "monitor and the handoff run there; with workers: 1 it is the router's one loop)",
            registry=r,
            buckets=LAG_BUCKETS_S,
        )
        self.control_loop_stall = Histogram(
            "narwhal_control_event_loop_stall_seconds",
            "The control process's loop lag, less the time its thread waited for a CPU",
            registry=r,
            buckets=LAG_BUCKETS_S,
        )
        self.lease_role = Gauge(
            "narwhal_lease_role", "1 for this router's lease role", ["role"], registry=r
        )
        self.lease_epoch = Gauge("narwhal_lease_epoch", "The epoch this router holds", registry=r)
        self.lease_acquisitions = Counter(
            "narwhal_lease_acquisitions", "Lease acquisitions by this router", registry=r
        )
        self.etcd_compactions = Counter(
            "narwhal_etcd_compactions",
            "etcd history compactions by the lease holder, by result",
            ["result"],
            registry=r,
        )
        for result in ("ok", "already_compacted", "failed"):
            self.etcd_compactions.labels(result)  # exported at 0 before the first tick
        self.etcd_db_size = Gauge(
            "narwhal_etcd_db_size_bytes",
            "etcd's database size (dbSize) as last read; 0 before the first read",
            registry=r,
        )
        self.etcd_db_size_in_use = Gauge(
            "narwhal_etcd_db_size_in_use_bytes",
            "The part of etcd's database in use (dbSizeInUse) as last read",
            registry=r,
        )
        self.etcd_alarm = Gauge(
            "narwhal_etcd_alarm_active",
            "1 while etcd reports the alarm (NOSPACE: writes refused)",
            ["alarm"],
            registry=r,
        )
        for alarm in ("NOSPACE", "CORRUPT"):
            self.etcd_alarm.labels(alarm)
        self.etcd_status_reads = Counter(
            "narwhal_etcd_status_reads",
            "Reads of etcd's status and alarms, by result",
            ["result"],
            registry=r,
        )
        for result in ("ok", "failed"):
            self.etcd_status_reads.labels(result)

        self.eligible_engines = Gauge(
            "narwhal_eligible_engines", "Eligible engines per role", ["role"], registry=r
        )
        self.consolidation_high = Gauge(
            "narwhal_consolidation_risk_high",
            "1 when a role has one or no eligible engine",
            ["role"],
            registry=r,
        )
        self.busiest_share = Gauge(
            "narwhal_consolidation_busiest_share",
            "The busiest engine's share of a role's requests in the last closed interval",
            ["role"],
            registry=r,
        )
        self.rebalances = Counter(
            "narwhal_role_rebalances",
            "Role rebalancing decisions after verification, by result",
            ["from_role", "to_role", "result"],
            registry=r,
        )
        for a, b in (("prefill", "decode"), ("decode", "prefill")):
            for result in ("moved", "verification_failed", "stale"):
                self.rebalances.labels(a, b, result)  # exported at 0 before the first move
        self.drift_detected = Counter(
            "narwhal_performance_drift_detected",
            "Intervals an engine was found drifting",
            ["engine"],
            registry=r,
        )
        self.engine_eligible = Gauge(
            "narwhal_engine_eligible",
            "1 when the engine may take new work",
            ["engine"],
            registry=r,
        )
        self.engine_ejected = Gauge(
            "narwhal_engine_ejected", "1 when the engine is ejected", ["engine"], registry=r
        )
        self.readmissions = Counter(
            "narwhal_readmissions",
            "Readmission attempts by result and failing step",
            ["engine", "result", "step"],
            registry=r,
        )

    def add_worker_metrics(self) -> None:
        """The control process's view of its data-plane workers (only when it runs some)."""
        r = self.registry
        self.workers_running = Gauge(
            "narwhal_workers", "Data-plane worker processes by state", ["state"], registry=r
        )
        self.worker_restarts = Counter(
            "narwhal_worker_restarts", "Data-plane workers restarted after an exit", registry=r
        )
        self.worker_exits = Counter(
            "narwhal_worker_exits",
            "Unplanned data-plane worker exits by reason: signal (killed), error (a non-zero "
            "exit status), clean (status 0)",
            ["reason"],
            registry=r,
        )
        for reason in ("signal", "error", "clean"):
            self.worker_exits.labels(reason)
        self.worker_lost_requests = Counter(
            "narwhal_worker_lost_requests",
            "Client requests in progress on a data-plane worker when it exited (failed; "
            "nothing charged to an engine)",
            ["endpoint"],
            registry=r,
        )
        for endpoint in ("completions", "chat"):
            self.worker_lost_requests.labels(endpoint)

    def render(self) -> bytes:
        return generate_latest(self.registry) + self.render_data()

    def data_totals(self, family: str, label: str) -> dict[str, float]:
        """A data-plane counter's totals by one label, as `/metrics` shows them (summed over
        the workers): for the admin views, read at request time."""
        totals: dict[str, float] = {}
        text = self.render_data().decode()
        for metric in text_string_to_metric_families(text):
            if metric.name != family:
                continue
            for sample in metric.samples:
                if sample.name == family + "_total" and label in sample.labels:
                    key = sample.labels[label]
                    totals[key] = totals.get(key, 0.0) + sample.value
        return totals
