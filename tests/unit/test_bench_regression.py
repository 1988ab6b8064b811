"""The router-bound regression check (issue 32 §3): Narwhal's CPU per request as a ratio to
the raw floor's in the same round, so a machine that runs 20% slower today moves both and
passes, while Narwhal's own rise beyond the noise fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import regression
from bench.report import router_wrk as report


def _suite(
    narwhal: list[float], floor: list[float], broken_rep: int | None = None
) -> dict[str, Any]:
    samples = []
    for rep, (n, f) in enumerate(zip(narwhal, floor, strict=True)):
        for target, cpu in (("narwhal-wauto", n), ("floor-raw", f), ("narwhal-wauto@base", n)):
            samples.append({"target": target, "stream": "no", "c": 64, "rep": rep,
                            "router_cpu_ms_per_1k": cpu, "broken": rep == broken_rep})  # fmt: skip
    return {"samples": samples}


def test_the_ratio_is_per_round_against_the_floor_and_skips_broken_rounds() -> None:
    ratios = regression.floor_ratios(_suite([400, 440, 380, 1], [100, 110, 100, 100], 3))
    assert list(ratios) == ["narwhal-wauto no 64"]  # an @base twin is not checked
    cell = ratios["narwhal-wauto no 64"]
    assert cell["ratio"] == 4.0 and cell["rounds"] == 3
    assert abs(cell["spread"] - (4.0 - 3.8) / 4.0) < 1e-9


def test_a_slower_machine_passes_and_narwhals_own_rise_fails(tmp_path: Path) -> None:
    path = tmp_path / "baseline.json"
    regression.record(_suite([400, 400, 400], [100, 100, 100]), "python -m bench ...", path)
    baseline = regression.load(path)
    slower_machine = _suite([500, 500, 500], [125, 125, 125])
    assert regression.verdict(slower_machine, baseline)["ok"] is True
    within_noise = _suite([430, 430, 430], [100, 100, 100])  # +7.5% < 10%
    assert regression.verdict(within_noise, baseline)["ok"] is True
    regressed = regression.verdict(_suite([460, 460, 460], [100, 100, 100]), baseline)
    assert regressed["ok"] is False
    assert regressed["regressions"] == [
        "narwhal-wauto no 64: 4.60x the floor's CPU per request, recorded 4.00x "
        "(+15%, allowed +10%)"
    ]
    assert "**Regressed**" in report._regression(regressed)


def test_a_noisy_run_widens_its_own_bound() -> None:
    baseline = {"ratios": regression.floor_ratios(_suite([400] * 3, [100] * 3))}
    noisy = _suite([460, 380, 500], [100, 100, 100])  # median 4.6, spread (5.0-3.8)/4.6
    found = regression.verdict(noisy, baseline)
    assert found["ok"] is True, found


def test_nothing_to_compare_is_said_not_passed() -> None:
    assert regression.verdict(_suite([400], [100]), None)["ok"] is None
    no_floor = {"samples": [{"target": "narwhal-w1", "stream": "no", "c": 64, "rep": 0,
                             "router_cpu_ms_per_1k": 400.0, "broken": False}]}  # fmt: skip
    baseline = {"ratios": {"narwhal-w1 no 64": {"ratio": 4.0, "spread": 0.0, "rounds": 3}}}
    assert regression.verdict(no_floor, baseline)["why"].startswith("no floor-raw")
    assert "Not checked" in report._regression(regression.verdict(no_floor, baseline))
