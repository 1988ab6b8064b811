"""The HTTP stack A/B section (bench.suites.floor_ab)."""

from __future__ import annotations

import math
from typing import Any

from bench.report.fmt import mb, num, ratio, table

RAW_RULE = 1.5  # issue 17: adopt a lower-level stack only for at least 1.5x less CPU per request
MODES = {"no": "json", "yes": "stream"}


def point(medians: list[dict[str, Any]], target: str, stream: str) -> dict[str, Any] | None:
    return next((m for m in medians if m["target"] == target and m["stream"] == stream), None)


def gain(medians: list[dict[str, Any]], stream: str, base: str, other: str, key: str) -> float:
    """`base`'s value over `other`'s (for CPU: how many times less `other` spends); NaN when
    either is missing."""
    a, b = point(medians, base, stream), point(medians, other, stream)
    if a is None or b is None:
        return math.nan
    x, y = float(a[key]), float(b[key])
    return x / y if y and not math.isnan(x) and not math.isnan(y) else math.nan


def render(suite: dict[str, Any]) -> str:
    med = suite["medians"]
    rows = []
    for m in med:
        floor = point(med, "floor", m["stream"])
        rows.append(
            [
                MODES[m["stream"]],
                m["target"],
                suite["stacks"].get(m["target"], "-"),
                suite["loops"].get(m["target"], "-"),
                num(m["throughput"], 0),
                num(m["p50_ms"], 2),
                num(m["p99_ms"], 2),
                num(m["router_cpu_s_per_1k"], 3),
                ratio(m["router_cpu_s_per_1k"], floor["router_cpu_s_per_1k"]) if floor else "-",
                num(m["engine_cpu_s_per_1k"], 3),
                mb(m["peak_rss_kb"]),
                num(m["processes"], 0),
                f"{m['client_cpu_util'] * 100:.0f}%",
                num(m["failed"], 0),
            ]
        )
    header = [
        "mode",
        "target",
        "stack",
        "loop (seen in /proc/PID/maps)",
        "req/s",
        "p50 ms",
        "p99 ms",
        "router CPU s / 1k req",
        "CPU ÷ floor's",
        "engines CPU s / 1k req",
        "peak RSS MB (all processes)",
        "processes",
        "load generator CPU",
        "failed",
    ]
    intro = (
        f"One prefill and one decode sim answering at once (no inter-token latency, no TTFT "
        f"delay), prompts of {suite['prompt_words']} words, `max_tokens` {suite['max_tokens']}, "
        f"c={suite['concurrency']}; {suite['reps']} round(s) of {suite['run_s']:.1f} s per "
        "target after a warm-up run, targets alternated, medians shown. Router CPU is utime + "
        "stime of every process of the target (the process started and its descendants, from "
        "/proc) over the measured run; *engines CPU* is the two sims' together; the load "
        "generator's CPU is a share of one core."
    )
    return intro + "\n\n" + table(header, rows) + "\n\n" + verdict(med) + "\n"


def verdict(med: list[dict[str, Any]]) -> str:
    lines = []
    cpu = "router_cpu_s_per_1k"
    for stream, label in MODES.items():
        raw = gain(med, stream, "floor", "floor-raw", cpu)
        uv = gain(med, stream, "floor", "floor-uvloop", cpu)
        nw = gain(med, stream, "narwhal", "narwhal-uvloop", cpu)
        nw_rps = gain(med, stream, "narwhal-uvloop", "narwhal", "throughput")
        if not math.isnan(raw):
            met = "meets" if raw >= RAW_RULE else "does not meet"
            lines.append(
                f"- {label}: floor-raw spends {raw:.2f}x less CPU per request than the floor "
                f"({met} the {RAW_RULE}x rule); uvloop alone under the same aiohttp floor: "
                f"{uv:.2f}x."
            )
        if not math.isnan(nw):
            lines.append(
                f"- {label}: Narwhal on uvloop spends {nw:.2f}x less CPU per request than on "
                f"asyncio, at {nw_rps:.2f}x the req/s."
            )
    return "\n".join(lines)
