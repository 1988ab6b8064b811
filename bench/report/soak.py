"""The chaos soak section: invariant counts for Narwhal, goodput for every router."""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.report.fmt import num, table

INVARIANTS = (
    ("hung_past_deadline", "no request hung past its deadline"),
    ("client_error_5xx", "no 5xx caused by a client error"),
    ("sent_to_ineligible", "no client request sent to an ejected, drained or held engine"),
    ("handoff_unparseable", "the handoff on disk always parses"),
    ("two_ready_routers", "never two routers answering /ready 200 at once"),
    ("drains_lost", "every drain survives takeover"),
    ("fd_or_memory_growth", "no fd or memory growth (per active stint)"),
)


def _goodput_row(name: str, g: dict[str, Any]) -> list[str]:
    causes = ", ".join(f"{k} {v}" for k, v in g["failed_by"].items()) or "-"
    bad = ", ".join(f"{k}: {v}" for k, v in g["bad_by_status"].items()) or "-"
    return [
        name,
        str(g["requests"]),
        str(g["ok"]),
        num(g["ok_per_s"], 1),
        str(g["failed"]),
        str(g["hung"]),
        causes,
        bad,
    ]


def render(suite: dict[str, Any]) -> str:
    n = suite["narwhal"]
    ev = n["evidence"]
    kinds = Counter(e["kind"] for e in n["events"])
    out = [
        f"Seed {suite['seed']}, {suite['duration_s']:.0f} s per router. Load: a closed loop of "
        f"{suite['concurrency']} clients, every other request streaming, {suite['max_tokens']} "
        f"tokens at {suite['itl_ms']:.0f} ms ITL, through two prefill and two decode sims "
        "behind the tap; plus one malformed or over-long request every 0.5 s. Request "
        f"deadline {suite['request_timeout_s']:.0f} s; the client gives up "
        f"{suite['client_margin_s']:.0f} s later (*hung*). Narwhal runs as an active/standby "
        f"pair sharing a `file` lease, policy `{n['policy']}`; the load follows whichever "
        "router answers `/ready` 200, polled every 0.1 s, as a load balancer would.",
        "",
        "Schedule ("
        + str(len(n["events"]))
        + " events): "
        + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        + f". Takeovers: {len(ev['takeovers'])} ("
        + ", ".join(
            f"{t['killed']}→{t['heir']} in {t['takeover_s']:.2f} s" for t in ev["takeovers"]
        )
        + f"); handoff-directory faults that the active's handoff stage reported: "
        f"{ev['handoff_dir_faults_with_stage_error']} of {ev['handoff_dir_faults']} "
        f"({', '.join(f'{k} {v}' for k, v in ev['handoff_stage_errors'].items()) or 'none'}).",
        "",
        "#### Invariants (Narwhal): violations",
        "",
        table(
            ["invariant", "violations", "checked over"],
            [[what, str(n["invariants"][key]), _over(key, n, suite)] for key, what in INVARIANTS],
        ),
        "",
        "#### Goodput",
        "",
        "The peers run the same schedule without the router-only events (handoff directory, "
        "router kills, drains and maintenance). *Bad requests*: the malformed and over-long "
        "requests' answers by status (`connection lost`: the router was killed under it).",
        "",
        table(
            [
                "router",
                "requests",
                "ok",
                "ok req/s",
                "failed",
                "hung",
                "failed by cause",
                "bad requests",
            ],
            [_goodput_row("narwhal", n["goodput"])]
            + [_goodput_row(name, p["goodput"]) for name, p in suite["peers"].items()],
        ),
        "",
    ]
    return "\n".join(out)


def _over(key: str, n: dict[str, Any], suite: dict[str, Any]) -> str:
    ev = n["evidence"]
    g = n["goodput"]
    return {
        "hung_past_deadline": f"{g['requests']} requests",
        "client_error_5xx": f"{g['bad_requests']} bad requests",
        "sent_to_ineligible": f"{ev['legs_at_engines']} legs, {ev['transitions']} transitions, "
        f"tolerance {suite['placement_tolerance_s']} s",
        "handoff_unparseable": f"{ev['handoff_polls']} polls",
        "two_ready_routers": f"{ev['ready_polls']} polls of both",
        "drains_lost": f"{ev['drain_checks']} drained engines after takeovers",
        "fd_or_memory_growth": f"{len(ev['stints'])} stints; tolerance +{suite['fd_tolerance']} "
        f"fds, +{suite['rss_tolerance_kb'] // 1024} MiB",
    }[key]
