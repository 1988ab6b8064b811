"""The profile suite's accounting (issue 32 §1): a py-spy sample's step is its innermost
Narwhal frame's module, and a step's microseconds per request are its share of the process's
busy samples times the process's CPU per request."""

from __future__ import annotations

from pathlib import Path

from bench.profiles import LOOP_STEP, step, steps
from bench.report import profile as report
from bench.suites.profile import per_step

# Collapsed stacks as `py-spy record --format raw --function` writes them (outermost first).
_R = "run (asyncio/runners.py)"
_A = "_attempt (narwhal/dataplane/plane.py)"
RAW = "\n".join(
    [
        f"{_R};data_received (narwhal/process/h1_connection.py);feed (narwhal/h1_body.py) 30",
        f"{_R};{_A};request (narwhal/engine/h1.py);write (asyncio/selector_events.py) 40",
        f"{_R};{_A};candidates (narwhal/fleet/store.py) 10",
        f"{_R};{_A};inc (narwhal/telemetry/metrics.py);inc (prometheus_client/values.py) 5",
        f"{_R};select (selectors.py) 15",
    ]
)


def test_a_sample_is_charged_to_its_innermost_narwhal_frame() -> None:
    def at(*files: str) -> str:
        return step([("f", file) for file in files])

    relay = "relay: engine legs (client side to engines)"
    assert at("asyncio/runners.py", "narwhal/dataplane/plane.py", "narwhal/engine/h1.py",
              "asyncio/selector_events.py") == relay  # fmt: skip
    assert at("narwhal/dataplane/plane.py", "narwhal/fleet/store.py") == "placement"
    assert at("narwhal/dataplane/plane.py", "narwhal/dataplane/auth.py") == "auth"
    assert at("narwhal/process/h1_connection.py").startswith("parse and connection")
    assert at("narwhal/dataplane/plane.py").startswith("request path")
    assert at("asyncio/runners.py", "selectors.py") == LOOP_STEP
    # A process's entry frames are not a step: the CLI, the spawner, a worker's main (its
    # other functions are).
    assert at("narwhal/cli/serve.py", "asyncio/base_events.py") == LOOP_STEP
    zygote = ("_run_child", "narwhal/process/zygote.py")
    loop = ("run", "asyncio/runners.py")
    assert step([zygote, ("main", "narwhal/process/worker.py"), loop]) == LOOP_STEP
    mirror = ("Worker._mirror_waiting", "narwhal/process/worker.py")
    assert step([zygote, mirror]).startswith("control plane")


def test_steps_are_shares_of_the_busy_samples(tmp_path: Path) -> None:
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    s = steps(path)
    assert s["samples"] == 100
    shares = dict(s["steps"])
    assert shares["relay: engine legs (client side to engines)"] == 0.40
    assert shares["parse and connection (HTTP/1 server)"] == 0.30
    assert shares[LOOP_STEP] == 0.15
    assert shares["placement"] == 0.10
    assert shares["metrics"] == 0.05
    assert sum(shares.values()) == 1.0
    assert s["self"][0] == ("write (asyncio/selector_events.py)", 0.40)  # the leaf's


def test_a_steps_microseconds_are_its_share_of_the_process_cpu(tmp_path: Path) -> None:
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    rows = per_step(steps(path)["steps"], 200.0)
    assert rows[0] == ["relay: engine legs (client side to engines)", 0.40, 80.0]
    assert sum(r[2] for r in rows) == 200.0


def test_the_report_sums_each_step_over_the_processes() -> None:
    def proc(us: float, split: list[tuple[str, float]]) -> dict[str, object]:
        return {
            "cpu_us_per_request": us,
            "file": "f.txt",
            "samples": 10,
            "steps": per_step(split, us),
            "self": [("f (narwhal/x.py)", 0.5)],
        }

    p = {
        "rps": 1000.0,
        "cpu_us_per_request": 500.0,
        "processes": {
            "control": proc(100.0, [("control plane (monitor, fleet, state)", 1.0)]),
            "worker 0": proc(200.0, [("metrics", 0.25), (LOOP_STEP, 0.75)]),
            "worker 1": proc(200.0, [("metrics", 0.5), (LOOP_STEP, 0.5)]),
        },
    }
    assert report.step_totals(p) == [
        (LOOP_STEP, 250.0),
        ("metrics", 150.0),
        ("control plane (monitor, fleet, state)", 100.0),
    ]
    text = report.render(
        {
            "rate_hz": 200,
            "seconds": 5,
            "concurrency": 64,
            "load": "wrk",
            "targets": {"narwhal-wauto": {"json": p}},
        }
    )
    assert "| metrics | - | 50 (25.0%) | 100 (50.0%) | 150 |" in text
    assert "narwhal-wauto, non-streaming (1000 req/s" in text
