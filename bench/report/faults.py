"""The goodput-under-faults section."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import num, table


def seconds(value: Any, never: str) -> str:
    return never if value is None else f"{float(value):.2f}"


def _migrated(r: dict[str, Any]) -> str:
    """Narwhal's migrations in the run: streams continued on a fresh pair (DESIGN §1), those
    that still failed, and the pause the clients saw, as histogram bucket bounds."""
    if "migrations" not in r:
        return "-"
    text = f"{r['migrations']:.0f} ({r['migrations_lost']:.0f})"
    if r["gap_p50_s"] is not None:
        text += f", ≤{r['gap_p50_s'] * 1000:.0f} / ≤{r['gap_p99_s'] * 1000:.0f}"
    return text


def render(suite: dict[str, Any]) -> str:
    after = f"not within {suite['after_s']:.0f} s"
    out = [
        f"Load: closed loop of {suite['concurrency']} clients, half of the requests streaming, "
        f"{suite['max_tokens']} tokens at {suite['itl_ms']:.0f} ms ITL; every router's request "
        f"deadline {suite['request_timeout_s']:.0f} s, the client gives up 2 s later (**hung**). "
        "**After first byte**: failed requests whose response body had begun reaching the "
        "client (a stream cut or ended with an error event), where DESIGN §1 forbids Narwhal "
        "a retry under either policy. "
        f"Schedule: {suite['warm_s']:.0f} s of load, the fault for {suite['fault_s']:.0f} s, "
        f"then {suite['after_s']:.0f} s more. **Out of rotation**: seconds from the fault's start "
        f"to the last client request the faulty engine received, provided it then received none "
        f"for the rest of the fault (at least {suite['quiet_s']:.0f} s); 'never' otherwise. "
        f"**Budget** (Narwhal's target): the time the {suite['eject_after']}rd request reached "
        f"the engine, plus the deadline that turns it into a failure, plus one monitor interval "
        f"({suite['monitor_interval_s']:.0f} s). **Back**: seconds from the end of the fault "
        f"to the first client request the engine received again. The load is a closed loop: "
        f"when every client is stuck on a stalled stream the faulty engine gets no traffic "
        f"either, so read *out of rotation* together with *ok req/s*. **Migrated**: Narwhal's "
        "streams continued on a fresh pair after their decode failed mid-stream (`bounded`; "
        "docs/dataplane.md#migration), how many of those still failed, and the pause their "
        "clients saw (`narwhal_migration_gap_seconds`, p50 and p99 as bucket bounds).",
        "",
    ]
    for scenario, what in suite["scenarios"].items():
        rows = []
        for r in suite["rows"]:
            if r["scenario"] != scenario:
                continue
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["failed_by"].items()))
            rows.append(
                [
                    r["router"],
                    str(r["requests"]),
                    str(r["failed"]),
                    str(r.get("failed_midstream", "-")),
                    str(r["hung"]),
                    reasons or "-",
                    seconds(r["out_of_rotation_s"], "never"),
                    seconds(r["budget_s"], "-"),
                    seconds(r["back_s"], after),
                    num(r["throughput"], 0),
                    _migrated(r),
                ]
            )
        header = ["router", "requests", "failed", "after first byte", "hung", "failures"]
        header += ["out of rotation s"]
        header += ["Narwhal budget s", "back s", "ok req/s", "migrated (lost), gap p50 / p99 ms"]
        out += [f"#### {scenario}", "", what + ".", "", table(header, rows), ""]
    return "\n".join(out)
