"""The control-plane cost section."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import mb, num, table

STAGES = ("controller", "health", "readmission", "liveness", "telemetry", "handoff")


def render(suite: dict[str, Any]) -> str:
    rows = []
    for r in suite["rows"]:
        rows.append(
            [
                str(r["engines"]),
                str(r["passes"]),
                num(r["cpu_ms_per_pass"], 1),
                num(r["pass_wall_ms"], 1),
                *(num(r["stage_ms"].get(s), 1) for s in STAGES),
                num(r["handoff_write_ms"], 2),
                f"{r['handoff_bytes'] / 1024:.0f}",
                str(r["stage_errors"]),
                mb(r["rss_kb"]),
            ]
        )
    header = ["engines", "passes", "CPU ms / pass", "pass wall ms"]
    header += [f"{s} ms" for s in STAGES]
    header += ["handoff write ms", "handoff KB", "failing passes", "RSS MB"]
    intro = (
        f"Engines: {suite['sims']} (a TCP relay, so every probe is answered by a real sim). "
        "No client traffic; CPU from /proc over the window divided by the passes in it; stage "
        "wall times are means over the router's last 20 passes (`/admin/monitor`); the handoff "
        "write time is `narwhal_handoff_write_seconds` (the whole stage: build, serialise, write, "
        "fsync, rename)."
    )
    return intro + "\n\n" + table(header, rows) + "\n"
