"""The sim's Prometheus metrics, on a registry of its own (one per app, never the global one).

vLLM's names where the router reads them (`process_start_time_seconds`,
`vllm:num_requests_running`, `vllm:num_requests_waiting`, and with a prefix cache
`vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`,
`vllm:cache_config_info`), `narwhal_sim_*` for the sim's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from narwhal.sim.faults import FaultKind
from narwhal.sim.leg import Leg


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """The prefix cache's shape, as `vllm:cache_config_info` labels it."""

    block_size: int
    num_gpu_blocks: int


class SimMetrics:
    def __init__(self, model: str, cache: CacheInfo | None = None) -> None:
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
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled (beyond --max-num-seqs, or for KV blocks)",
            ["model_name"],
            registry=r,
        ).labels(model_name=model)
        self._kv_usage: Gauge | None = None
        self._prefix_queries: Counter | None = None
        self._prefix_hits: Counter | None = None
        if cache is not None:
            self._cache_metrics(r, model, cache)
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

    def _cache_metrics(self, r: CollectorRegistry, model: str, cache: CacheInfo) -> None:
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            ["model_name"],
            registry=r,
        ).labels(model_name=model)
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            ["model_name"],
            registry=r,
        ).labels(model_name=model)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            ["model_name"],
            registry=r,
        ).labels(model_name=model)
        info = {
            "block_size": str(cache.block_size),
            "num_gpu_blocks": str(cache.num_gpu_blocks),
            "enable_prefix_caching": "True",
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=r,
        ).labels(**info).set(1)

    def watch(
        self,
        *,
        running: Callable[[], float],
        waiting: Callable[[], float],
        start_time: Callable[[], float],
        handoffs_held: Callable[[], float],
        kv_cache_usage: Callable[[], float],
    ) -> None:
        """Read the engine's gauges at scrape time (nothing to update on the request path)."""
        self._running.set_function(running)
        self._waiting.set_function(waiting)
        self._start_time.set_function(start_time)
        self._held.set_function(handoffs_held)
        if self._kv_usage is not None:
            self._kv_usage.set_function(kv_cache_usage)

    def count_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        if self._prefix_queries is not None and self._prefix_hits is not None:
            self._prefix_queries.inc(queried_tokens)
            self._prefix_hits.inc(hit_tokens)

    def count_request(self, leg: Leg) -> None:
        self._requests[leg].inc()

    def fault_fired(self, kind: FaultKind) -> None:
        self.faults_fired.labels(kind=kind.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
