"""The per-step profile section: each Narwhal process's CPU per request, split by step."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import num, table


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def step_totals(p: dict[str, Any]) -> list[tuple[str, float]]:
    """Each step's microseconds per request over all of a router's processes, largest first."""
    totals: dict[str, float] = {}
    for proc in p["processes"].values():
        for name, _share, us in proc.get("steps", []):
            totals[name] = totals.get(name, 0.0) + us
    return sorted(totals.items(), key=lambda kv: -kv[1])


def _steps_table(p: dict[str, Any]) -> str:
    roles = list(p["processes"])
    rows = []
    for name, total in step_totals(p):
        cells = []
        for role in roles:
            by_name = {s[0]: s for s in p["processes"][role].get("steps", [])}
            s = by_name.get(name)
            cells.append(f"{s[2]:.0f} ({_pct(s[1])})" if s else "-")
        rows.append([name, *cells, f"{total:.0f}"])
    rows.append(
        [
            "**CPU per request (all, idle included)**",
            *[num(p["processes"][r]["cpu_us_per_request"], 0) for r in roles],
            num(p["cpu_us_per_request"], 0),
        ]
    )
    return table(["step", *[f"{r} µs (share)" for r in roles], "all µs"], rows)


def render(suite: dict[str, Any]) -> str:
    if "error" in suite:
        return f"Not run: {suite['error']}"
    out = [
        f"py-spy {suite['rate_hz']} Hz on every process of the router, {suite['seconds']:.0f} s "
        f"per profile, {suite['concurrency']} connections ({suite['load']}). A process's "
        "CPU per request is its /proc CPU over the run divided by the requests wrk completed; a "
        "step's microseconds per request are its share of the process's busy samples times "
        "that (the process's idle loop, waiting in epoll, is not sampled, and its small cost "
        "is spread over the steps). A sample's step is the innermost Narwhal frame's module "
        "(`bench/profiles.py`): a library call, a socket write or the event loop's C code "
        "counts toward the Narwhal step that made it; `event loop (no Narwhal frame)` is the "
        "loop's own work between callbacks.",
        "",
    ]
    for target, by_key in suite.get("targets", {}).items():
        for key, title in (("json", "non-streaming"), ("stream", "streaming")):
            p = by_key.get(key)
            if not p:
                continue
            out += [
                f"#### {target}, {title} ({p['rps']:.0f} req/s while sampled, "
                f"{p['cpu_us_per_request']:.0f} CPU-µs per request)",
                "",
                _steps_table(p),
                "",
            ]
            for role, proc in p["processes"].items():
                if "error" in proc:
                    out += [f"py-spy failed on {role}: `{proc['error']}`", ""]
                    continue
                top = ", ".join(f"`{f.split(' (')[0]}` {_pct(s)}" for f, s in proc["self"][:8])
                out += [
                    f"Top self time, {role} ({proc['samples']} samples, `{proc['file']}`): {top}.",
                    "",
                ]
    return "\n".join(out)
