"""The many-streams section."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import mb, num, table


def render(suite: dict[str, Any]) -> str:
    rows = []
    for r in suite["rows"]:
        gap = r["gap_ms"]
        rows.append(
            [
                r["target"],
                str(r["peak_in_flight"]),
                num(r["steady_chunks_per_s"], 0),
                num(gap.get("p50"), 0),
                num(gap.get("p99"), 0),
                num(gap.get("max"), 0),
                str(r["stalls"]),
                f"{r['failed']} / {r['hung']}",
                num(r["router_cpu_s"], 2),
                num(r["cpu_ms_per_stream"], 2),
                num(r["cpu_us_per_chunk"], 1),
                mb(r["rss_before_kb"]),
                mb(r["peak_rss_kb"]),
                num(r["memory_per_stream_kb"], 1),
            ]
        )
    header = [
        "target",
        "streams open",
        "chunks/s",
        "gap p50 ms",
        "gap p99 ms",
        "gap max ms",
        f"stalls (> {suite['stall_ms']:.0f} ms)",
        "failed / hung",
        "router CPU s",
        "CPU ms / stream",
        "router CPU µs / chunk",
        "idle RSS MB",
        "peak RSS MB",
        "KB / stream",
    ]
    intro = (
        f"{suite['streams']} concurrent streams, {suite['tokens']} tokens each at "
        f"{suite['itl_ms']:.0f} ms inter-token latency, {suite['ramp_s']:.1f} s ramp then "
        f"{suite['run_s']:.0f} s steady; a worker opens its next stream when one ends."
    )
    return intro + "\n\n" + table(header, rows) + "\n" + _attribution(suite) + "\n"


def _attribution(suite: dict[str, Any]) -> str:
    a = suite.get("attribution")
    if not a:
        return ""
    rows = [[f"`{m['module']}`", num(m["kb_per_stream"], 2)] for m in a["modules"]]
    narwhal = next((r for r in suite["rows"] if r["target"] == "narwhal"), {})
    return (
        f"\n**Where a stream's memory goes.** Narwhal again under `tracemalloc` "
        f"(`python -m bench.traced`), with {a['open_streams']:.0f} legs in flight at the "
        f"snapshot: Python allocations held by the open streams, by the module that made them "
        f"(top 12), per stream. Traced Python memory: {a['traced_kb_per_stream']:.1f} KB per "
        f"stream. The RSS figure above ({num(narwhal.get('memory_per_stream_kb'), 1)} KB) "
        "differs: streams reuse memory the idle process had already taken from the OS, and "
        "the allocator adds its own overhead.\n\n" + table(["module", "KB / stream"], rows)
    )
