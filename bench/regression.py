"""Holding the gains (issue 32 §3): Narwhal's CPU per request under wrk, checked against the
last recorded run, failing `make bench` loudly when it rises by more than the noise.

What is compared is not the absolute CPU per request, which moves 10-30% between runs of the
same tree on one machine (docs/performance-log.md), but its ratio to the raw floor's
(`floor-raw`: the same HTTP stack doing only the relay) measured in the same round of the same
run: the machine's drift falls on both. Per cell (target, mode, concurrency) the median of the
rounds' ratios is compared with the recorded one; the tolerance is the larger of
`MIN_TOLERANCE` and each run's own spread of that ratio over its rounds, so a noisy run widens
its own bound rather than failing for noise. `bench/baselines/router_wrk.json` holds the last
accepted run (`python -m bench ... --record-baseline` writes it, after a change that was
measured and kept).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from bench.stats import median

BASELINE = Path(__file__).parent / "baselines" / "router_wrk.json"
FLOOR = "floor-raw"
MIN_TOLERANCE = 0.10


def floor_ratios(suite: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per Narwhal cell `target stream c`: the median over rounds of its router CPU per
    request ÷ floor-raw's in the same round, and the spread of those ratios ((max - min) ÷
    median). Rounds where either run was broken make no ratio."""
    by: dict[tuple[str, str, int, int], float] = {}
    for r in suite.get("samples", []):
        if not r.get("broken") and not math.isnan(float(r["router_cpu_ms_per_1k"])):
            by[(r["target"], r["stream"], int(r["c"]), int(r["rep"]))] = float(
                r["router_cpu_ms_per_1k"]
            )
    per_cell: dict[str, list[float]] = {}
    for (target, stream, c, rep), cpu in by.items():
        floor = by.get((FLOOR, stream, c, rep))
        if not target.startswith("narwhal") or "@" in target or not floor:
            continue
        per_cell.setdefault(f"{target} {stream} {c}", []).append(cpu / floor)
    out = {}
    for key, ratios in sorted(per_cell.items()):
        mid = median(ratios)
        out[key] = {
            "ratio": mid,
            "spread": (max(ratios) - min(ratios)) / mid,
            "rounds": len(ratios),
        }
    return out


def check(
    current: dict[str, dict[str, float]],
    baseline: dict[str, dict[str, float]],
    min_tolerance: float = MIN_TOLERANCE,
) -> tuple[list[str], list[str]]:
    """(regressions, cells compared): a cell regressed when its ratio rose by more than the
    tolerance over the recorded one."""
    problems, compared = [], []
    for key, now in sorted(current.items()):
        before = baseline.get(key)
        if before is None:
            continue
        allowed = max(min_tolerance, now["spread"], before["spread"])
        rise = now["ratio"] / before["ratio"] - 1
        line = (
            f"{key}: {now['ratio']:.2f}x the floor's CPU per request, recorded "
            f"{before['ratio']:.2f}x ({rise:+.0%}, allowed +{allowed:.0%})"
        )
        compared.append(line)
        if rise > allowed:
            problems.append(line)
    return problems, compared


def load(path: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return doc


def record(suite: dict[str, Any], command: str, path: Path = BASELINE) -> dict[str, Any]:
    """This run's ratios as the new baseline."""
    doc = {
        "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
        "min_tolerance": MIN_TOLERANCE,
        "ratios": floor_ratios(suite),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return doc


def verdict(suite: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The check as the results and the report keep it: `ok` False on a regression, None when
    nothing could be compared (no baseline, no floor, no common cell)."""
    if baseline is None:
        return {"ok": None, "why": f"no baseline recorded ({BASELINE.name})"}
    current = floor_ratios(suite)
    if not current:
        return {"ok": None, "why": f"no {FLOOR} rounds to compare with"}
    problems, compared = check(
        current, baseline["ratios"], baseline.get("min_tolerance", MIN_TOLERANCE)
    )
    if not compared:
        return {"ok": None, "why": "no cell in common with the baseline"}
    return {
        "ok": not problems,
        "regressions": problems,
        "compared": compared,
        "baseline_recorded_at": baseline.get("recorded_at"),
    }
