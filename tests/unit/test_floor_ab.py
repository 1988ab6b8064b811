"""The HTTP stack A/B's pure parts: which processes count as the target's, and the ratios its
verdict is read from."""

from __future__ import annotations

import math
import os

from bench import floor_granian
from bench.procs import descendants, tree_usage
from bench.report.floor_ab import gain

from narwhal.engine.vllm import PREFILL_KV_PARAMS


def test_descendants_are_the_root_and_everything_below_it_only() -> None:
    parent_of = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20, 30: 99}
    assert descendants(parent_of, 10) == [10, 11, 12, 13]
    assert sorted(descendants(parent_of, 1)) == [1, 10, 11, 12, 13, 20, 21]
    assert descendants(parent_of, 13) == [13]
    assert descendants(parent_of, 30) == [30]  # a root whose parent is not listed


def test_tree_usage_reads_this_process() -> None:
    cpu, hwm_kb, processes = tree_usage(os.getpid())
    assert cpu > 0 and hwm_kb > 0 and processes >= 1


def _m(target: str, stream: str, cpu: float, rps: float) -> dict[str, object]:
    return {"target": target, "stream": stream, "router_cpu_s_per_1k": cpu, "throughput": rps}


def test_gain_is_base_over_other_and_nan_when_a_side_is_missing_or_zero() -> None:
    med = [
        _m("floor", "no", 1.05, 600),
        _m("floor-raw", "no", 0.35, 900),
        _m("floor", "yes", 1.2, 500),
        _m("floor-raw", "yes", 0.0, 700),
    ]
    key = "router_cpu_s_per_1k"
    assert math.isclose(gain(med, "no", "floor", "floor-raw", key), 3.0)
    assert math.isclose(gain(med, "no", "floor-raw", "floor", "throughput"), 1.5)
    assert math.isnan(gain(med, "no", "floor", "narwhal", key))
    assert math.isnan(gain(med, "yes", "floor", "floor-raw", key))


def test_the_granian_floor_asks_prefill_for_the_same_handoff_as_narwhal() -> None:
    assert floor_granian.PREFILL_KV_PARAMS == PREFILL_KV_PARAMS  # a copy: it cannot import it
