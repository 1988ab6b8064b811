"""What one load run does (`RunSpec`) and what it measured (`RunResult`), as plain JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MARKER = "bnchld"  # in every prompt the load generator sends: the tap counts it per engine


@dataclass(frozen=True, slots=True)
class RunSpec:
    """A closed loop of `concurrency` clients, bounded in requests and in time.

    `target` is `router` (POST to `url`) or `direct` (the client runs the PD round trip itself
    against `prefill` and `decode`). `stream` is `yes`, `no` or `mixed` (alternating).
    """

    name: str
    target: str
    concurrency: int
    max_requests: int
    duration_s: float
    deadline_s: float
    model: str
    stream: str = "no"
    url: str = ""
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    max_tokens: int = 16
    prompt_words: int = 32
    ramp_s: float = 0.0
    warmup_requests: int = 0
    records: bool = False  # every request's (start, end, outcome, streamed, midstream)
    stall_ms: float = 1000.0  # a gap between two chunks of one stream longer than this stalls
    # Paired (c=1): each round sends one request to each of these ("" = direct) in rotated
    # order, so slow drift in the machine's speed hits every target alike.
    paired: tuple[str, ...] = ()
    # Routers behind a load balancer (the soak's active/standby pair): each request goes to
    # the one that last answered /ready 200, polled every 0.1 s as a load balancer would.
    failover: tuple[str, ...] = ()
    # A router that requires a client key: `Authorization: Bearer <api_key>` on every request
    # to it ("" sends none; never on a direct run's engine legs)
    api_key: str = ""
    # The `cache` suite: prompts from this workload (bench.loadgen.workloads, as JSON) instead
    # of `prompt_words`; each client sends a session's prompts one after another.
    workload: dict[str, Any] | None = None
    ttft_slo_ms: float = 0.0  # > 0: count the requests whose first token came within it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RunSpec:
        doc = dict(doc)
        doc["prefill"] = tuple(doc.get("prefill", ()))
        doc["decode"] = tuple(doc.get("decode", ()))
        doc["paired"] = tuple(doc.get("paired", ()))
        doc["failover"] = tuple(doc.get("failover", ()))
        return cls(**doc)


@dataclass(slots=True)
class RunResult:
    name: str
    started: int = 0
    ok: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # reason -> count
    hung: int = 0  # still unanswered at the client's deadline
    t_start: float = 0.0  # time.monotonic() (CLOCK_MONOTONIC, shared by all processes)
    t_end: float = 0.0
    latency_ms: dict[str, float] = field(default_factory=dict)  # p50, p90, p99, max, mean
    ttft_ms: dict[str, float] = field(default_factory=dict)
    chunks: int = 0  # SSE data events received (without [DONE])
    gap_ms: dict[str, float] = field(default_factory=dict)  # between chunks of one stream
    stalls: int = 0
    steady_chunks_per_s: float = 0.0  # data events per second between ramp-up and the end
    peak_in_flight: int = 0
    client_cpu_s: float = 0.0
    records: list[tuple[float, float, str, int, int]] = field(default_factory=list)
    # paired runs: per entry of spec.paired, latency and TTFT summaries, and the median of the
    # per-round differences to the first entry
    paired: list[dict[str, Any]] = field(default_factory=list)
    good: int = 0  # ok, and (streamed) its first token within spec.ttft_slo_ms

    @property
    def elapsed_s(self) -> float:
        return max(1e-9, self.t_end - self.t_start)

    @property
    def failures(self) -> int:
        return sum(self.failed.values())

    @property
    def throughput(self) -> float:
        return self.ok / self.elapsed_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RunResult:
        doc = dict(doc)
        doc["records"] = [tuple(r) for r in doc.get("records", [])]
        return cls(**doc)
