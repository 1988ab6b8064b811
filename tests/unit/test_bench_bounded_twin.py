"""router_bound's bounded twin: Narwhal at a workers value run again under `serving.policy:
bounded`, its name, where it runs in the plan, and the report's bounded ÷ single_attempt."""

from __future__ import annotations

import math
from typing import Any

import pytest
from bench.cli import _parser
from bench.context import router_spec
from bench.modes import MODES
from bench.report import router_bound as report
from bench.suites.router_bound import bounded_target, parse_twin, plan


@pytest.mark.parametrize(
    ("name", "workers", "policy"),
    [
        ("narwhal-wauto-bounded", "auto", "bounded"),
        ("narwhal-w2-bounded", 2, "bounded"),
        ("narwhal-w2", 2, "single_attempt"),
        ("narwhal-bounded", None, "bounded"),
    ],
)
def test_a_name_ending_in_bounded_runs_the_bounded_policy(
    name: str, workers: int | str | None, policy: str
) -> None:
    spec = router_spec(name)
    assert (spec.kind, spec.workers, spec.policy) == ("narwhal", workers, policy)


def test_each_twin_runs_right_after_its_single_attempt_target_and_only_from_the_sweep() -> None:
    workers, twins, _ = plan(("1", "2", "auto"), ("auto", "4"), ab=False)
    assert list(workers) == ["narwhal-w1", "narwhal-w2", "narwhal-wauto", "narwhal-wauto-bounded"]
    assert workers[bounded_target("auto")] == "auto"
    assert twins == {"narwhal-wauto-bounded": "narwhal-wauto"}
    assert plan(("1", "auto"), (), ab=False)[1] == {}


def test_with_ab_src_the_twin_has_a_base_twin_paired_with_the_base_target() -> None:
    workers, twins, _ = plan(("auto",), ("auto",), ab=True)
    assert list(workers) == [
        "narwhal-wauto",
        "narwhal-wauto@base",
        "narwhal-wauto-bounded",
        "narwhal-wauto-bounded@base",
    ]
    assert twins["narwhal-wauto-bounded@base"] == "narwhal-wauto@base"


def test_the_cli_replaces_the_modes_twin_list_or_turns_it_off() -> None:
    assert parse_twin("none") == ()
    assert parse_twin("1, auto") == ("1", "auto")
    with pytest.raises(ValueError, match="worker count"):
        parse_twin("0")
    assert _parser().parse_args(["--report", "r", "--results", "d"]).bounded_twin is None
    args = _parser().parse_args(["--report", "r", "--results", "d", "--bounded-twin", "none"])
    assert args.bounded_twin == ()


def test_quick_and_full_modes_run_the_twin_at_auto() -> None:
    for mode in (MODES["quick"], MODES["full"]):
        assert "auto" in mode.router_bound_bounded
        assert set(mode.router_bound_bounded) <= set(mode.router_bound_workers)
        assert "yes" in mode.router_bound_bounded_streams


def _point(target: str, stream: str, c: int, rps: float, cpu: float) -> dict[str, Any]:
    return {
        "target": target,
        "stream": stream,
        "c": c,
        "reps": 3,
        "throughput": rps,
        "router_cpu_s_per_1k": cpu,
        "p50_ms": 10.0,
        "p99_ms": 20.0,
        "cpu_us_per_chunk": math.nan,
        "rss_kb": 1024,
        "client_cpu_util": 0.2,
        "failed": 0,
        "failed_by": {},
        "outcomes": {"ok": 100},
        "requests": 100,
        "procs": {},
        "restarted": [],
    }


def _suite(twin: bool) -> dict[str, Any]:
    medians = [
        _point("narwhal-wauto", "yes", 64, 1000.0, 0.30),
        _point("narwhal-wauto-bounded", "yes", 64, 900.0, 0.36),
        _point("vllm-router", "yes", 64, 1000.0, 0.30),
        _point("narwhal-wauto", "no", 64, 1200.0, 0.25),  # no twin in json here
        _point("vllm-router", "no", 64, 1000.0, 0.30),
    ]
    suite: dict[str, Any] = {
        "targets": ["narwhal-wauto", "narwhal-wauto-bounded", "vllm-router"],
        "workers": {"narwhal-wauto": "auto", "narwhal-wauto-bounded": "auto"},
        "worker_processes": {"narwhal-wauto": 2, "narwhal-wauto-bounded": 2},
        "concurrency": [64],
        "max_tokens": 8,
        "prompt_words": 32,
        "run_s": 4.0,
        "reps": 3,
        "medians": medians,
    }
    if twin:
        suite["bounded"] = {"narwhal-wauto-bounded": "narwhal-wauto"}
        suite["bounded_streams"] = ["yes"]
    return suite


def test_the_report_shows_bounded_over_single_attempt_per_cell() -> None:
    suite = _suite(twin=True)
    [cell] = report.bounded_cells(suite)  # json has no twin point: no row
    assert (cell["stream"], cell["c"], cell["single"]) == ("yes", 64, "narwhal-wauto")
    assert math.isclose(cell["rps_x"], 0.9)
    assert math.isclose(cell["cpu_x"], 1.2)
    text = report.render(suite)
    assert "#### Bounded twin" in text
    assert "| stream | 64 | auto (2) | 1,000 | 900 | **0.90x** | 0.300 | 0.360 | **1.20x**" in text


def test_the_twin_is_never_the_judged_variant_and_old_results_render_without_it() -> None:
    suite = _suite(twin=True)
    assert report.judged(suite) == "narwhal-wauto"
    suite["targets"] = ["narwhal-wauto-bounded", "narwhal-wauto", "vllm-router"]
    assert report.judged(suite) == "narwhal-wauto"
    old = _suite(twin=False)
    old["workers"].pop("narwhal-wauto-bounded")
    old["targets"].remove("narwhal-wauto-bounded")
    assert report.bounded_cells(old) == []
    assert "Bounded twin" not in report.render(old)
