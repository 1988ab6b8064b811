"""The sim's Prometheus metrics, on a registry of its own (one per app, never the global one).

vLLM's names where the router reads them (`process_start_time_seconds`,
`vllm:num_requests_running`, `vllm:num_requests_waiting`), `narwhal_sim_*` for the sim's own.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from narwhal.sim.faults import FaultKind
from narwhal.sim.leg import Leg


class SimMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._start_time = Gauge(
            "process_start_time_seconds",
            "Start time of the engine process (newer after a restart)",
            registry=r,
        )
        self._running = Gauge(
            "vllm:num_requests_running", "Requests in the engine", ["model_name"], registry=r
        ).labels(model_name=model)
        Gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled (the sim never queues)",
            ["model_name"],
            registry=r,
        ).labels(model_name=model).set(0)
        self._held = Gauge(
            "narwhal_sim_kv_handoffs_held", "Handoffs kept for a decode engine", registry=r
        )
        requests = Counter(
            "narwhal_sim_requests", "Completion requests by leg", ["leg"], registry=r
        )
        self._requests = {leg: requests.labels(leg=leg.value) for leg in Leg}
        self.rejected = Counter(
            "narwhal_sim_rejected", "Completions refused above --max-concurrency", registry=r
        )
        self.kv_blocks_served = Counter(
            "narwhal_sim_kv_blocks_served", "KV blocks read by decode engines", registry=r
        )
        self.kv_blocks_received = Counter(
            "narwhal_sim_kv_blocks_received", "KV blocks loaded from prefill engines", registry=r
        )
        self.kv_load_failures = Counter(
            "narwhal_sim_kv_load_failures", "Handoffs that could not be read", registry=r
        )
        self.kv_recomputes = Counter(
            "narwhal_sim_kv_recomputes", "Decode legs that recomputed the prompt", registry=r
        )
        self.faults_fired = Counter(
            "narwhal_sim_faults_fired", "Injected faults that fired", ["kind"], registry=r
        )

    def watch(
        self,
        *,
        running: Callable[[], float],
        start_time: Callable[[], float],
        handoffs_held: Callable[[], float],
    ) -> None:
        """Read the engine's gauges at scrape time (nothing to update on the request path)."""
        self._running.set_function(running)
        self._start_time.set_function(start_time)
        self._held.set_function(handoffs_held)

    def count_request(self, leg: Leg) -> None:
        self._requests[leg].inc()

    def fault_fired(self, kind: FaultKind) -> None:
        self.faults_fired.labels(kind=kind.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
