"""The hot-path profile section."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import table


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render(suite: dict[str, Any]) -> str:
    out = [
        f"py-spy {suite['rate_hz']} Hz, {suite['seconds']:.0f} s per profile, Narwhal with "
        f"{suite['concurrency']} clients; shares are of busy samples (idle epoll waits left out).",
        "",
    ]
    for key, title in (("json", "Non-streaming"), ("stream", "Streaming")):
        p = suite.get(key)
        if not p:
            continue
        if "error" in p:
            out += [f"#### {title}", "", f"py-spy failed: `{p['error']}`", ""]
            continue
        out += [
            f"#### {title} ({p['throughput']:.0f} req/s while sampled, {p['samples']} samples, "
            f"`{p['file']}`)",
            "",
            "By area (where the leaf frame is):",
            "",
            table(["area", "share"], [[a, _pct(s)] for a, s in p["areas"]]),
            "",
            "Top functions by self time:",
            "",
            table(["function (file)", "self"], [[f"`{f}`", _pct(s)] for f, s in p["self"]]),
            "",
            "Narwhal functions by inclusive time:",
            "",
            table(
                ["function (file)", "inclusive"],
                [[f"`{f}`", _pct(s)] for f, s in p["inclusive_narwhal"]],
            ),
            "",
        ]
    return "\n".join(out)
