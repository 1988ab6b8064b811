"""An engine's load as its own `/metrics` reports it (DESIGN §11): the requests waiting in its
queue, those running, how full its KV cache is, and how large that cache is. Pure: Prometheus
text in, a record out.

vLLM labels each series (`model_name`, `engine` per data-parallel rank): waiting and running
are summed over the series, KV usage is the fullest rank's, the cache's size (its
`vllm:cache_config_info` labels `num_gpu_blocks` x `block_size`) the ranks' sum. A scrape older
than `placement.metrics_stale_s` is ignored (`fresh`), never guessed from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SERIES = re.compile(
    rb"^(vllm:num_requests_waiting|vllm:num_requests_running|vllm:kv_cache_usage_perc)"
    rb"(?:\{[^}]*\})?\s+([0-9.eE+\-]+|NaN)\s*$",
    re.M,
)
_CACHE_INFO = re.compile(rb"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL = re.compile(rb'(\w+)="([^"]*)"')


@dataclass(frozen=True, slots=True)
class EngineLoad:
    waiting: int
    running: int
    kv_usage: float  # 0..1
    at: float  # when it was scraped (monotonic)
    capacity_tokens: int | None = None  # the KV cache's size, where the engine reports it

    def fresh(self, now: float, stale_s: float) -> bool:
        return now - self.at <= stale_s


def parse_load(text: bytes, at: float) -> EngineLoad | None:
    """The load in a `/metrics` page; None when it reports no queue (not vLLM, or too old)."""
    waiting = running = 0.0
    usage = 0.0
    seen = set()
    for match in _SERIES.finditer(text):
        name, raw = match[1], match[2]
        try:
            value = float(raw)
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        seen.add(name)
        if name == b"vllm:num_requests_waiting":
            waiting += value
        elif name == b"vllm:num_requests_running":
            running += value
        else:
            usage = max(usage, value)
    if b"vllm:num_requests_waiting" not in seen:
        return None
    kv_usage = min(max(usage, 0.0), 1.0)
    return EngineLoad(int(waiting), int(running), kv_usage, at, _capacity_tokens(text))


def _capacity_tokens(text: bytes) -> int | None:
    """`num_gpu_blocks` x `block_size` from `vllm:cache_config_info`, summed over the ranks;
    None when absent or not numbers (a cache not yet profiled says `None`)."""
    total = 0
    for match in _CACHE_INFO.finditer(text):
        labels = dict(_LABEL.findall(match[1]))
        try:
            total += int(labels[b"num_gpu_blocks"]) * int(labels[b"block_size"])
        except (KeyError, ValueError):
            return None
    return total or None
