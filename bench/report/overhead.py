"""The overhead section: one table per stream mode, then Narwhal's ratios to each peer."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import is_peer, mb, num, ratio, table


def point(suite: dict[str, Any], target: str, stream: str, c: int) -> dict[str, Any] | None:
    for p in suite["medians"]:
        if p["target"] == target and p["stream"] == stream and p["c"] == c:
            return dict(p)
    return None


def paired_added(suite: dict[str, Any], target: str, stream: str = "no") -> float | None:
    """The target's p50 minus direct's in the interleaved c=1 run, when there was one."""
    for run in suite.get("paired", []):
        if run["stream"] != stream:
            continue
        rows = {r["target"]: r for r in run["rows"]}
        if target in rows and "direct" in rows:
            return float(rows[target]["latency_ms"]["p50"] - rows["direct"]["latency_ms"]["p50"])
    return None


def _paired(suite: dict[str, Any]) -> list[str]:
    runs = suite.get("paired", [])
    if not runs:
        return []
    rows = []
    for run in runs:
        base = {r["target"]: r for r in run["rows"]}.get("direct")
        for r in run["rows"]:
            lat = r["latency_ms"]
            rows.append(
                [
                    "stream" if run["stream"] == "yes" else "json",
                    r["target"],
                    str(r["rounds"]),
                    num(lat.get("p50"), 2),
                    num(lat.get("p99"), 2),
                    num(lat["p50"] - base["latency_ms"]["p50"], 2) if base else "-",
                    num(r["diff_p50_ms"], 2),
                    num(r["failed"], 0),
                ]
            )
    header = ["mode", "target", "rounds", "p50 ms", "p99 ms", "added p50 ms"]
    header += ["median of per-round differences ms", "failed"]
    return [
        "#### Added latency at c=1, paired",
        "",
        f"One request at a time, each round one request to every target in rotated order, "
        f"{runs[0]['duration_s']:.0f} s per mode: the machine's slow drift in speed (±1 ms "
        "between runs of the table above) falls on every target alike. *added p50* is the "
        "target's p50 minus direct's in this run; this is the figure the c=1 target is judged "
        "on. **floor** is `bench/floor.py`: the same HTTP stack as Narwhal (aiohttp, orjson) "
        "doing only the wire work any vLLM PD proxy must do (read the body, prefill, parse the "
        "handoff, decode, relay the bytes), with no validation, deadlines, placement, "
        "evidence or metrics. It is not a router; it measures the stack's own cost.",
        "",
        table(header, rows),
        "",
    ]


def _rows(suite: dict[str, Any], stream: str) -> list[list[str]]:
    rows = []
    cs = sorted({p["c"] for p in suite["medians"]})
    for c in cs:
        direct = point(suite, "direct", stream, c)
        for target in suite["targets"]:
            p = point(suite, target, stream, c)
            if p is None:
                continue
            added = num(p["p50_ms"] - direct["p50_ms"], 2) if direct and target != "direct" else "-"
            row = [
                str(c),
                target,
                num(p["throughput"], 0),
                num(p["p50_ms"], 2),
                num(p["p99_ms"], 2),
            ]
            if stream == "yes":
                row += [num(p["ttft_p50_ms"], 2), num(p["ttft_p99_ms"], 2)]
            row += [
                num(p["router_cpu_s_per_1k"], 3),
                mb(p["peak_rss_kb"]),
                num(p["failed"], 0),
                ratio(p["throughput"], direct["throughput"]) if direct else "-",
                added,
            ]
            rows.append(row)
    return rows


def _intro(suite: dict[str, Any]) -> str:
    flags = suite["sim_flags"]
    samples = suite["samples"]
    client = max((s["client_cpu_util"] for s in samples), default=0.0)
    reps = max((s["rep"] for s in samples), default=0) + 1
    return (
        f"One prefill and one decode sim (ITL {flags['itl_ms']} ms, TTFT "
        f"{flags['ttft_per_token_ms']} ms per prompt token), prompts of "
        f"{suite['prompt_words']} words, {suite['max_tokens']} tokens out (a stream is "
        f"{suite['max_tokens']} events and `[DONE]`). Each point: {reps} round(s) of "
        f"{suite.get('run_s', 0):.1f} s per target (twice that at c=1) after a warm-up, targets "
        "alternated; medians "
        f"shown. The load generator used at most {client:.0%} of one core in any run. "
        "*Added p50* is the target's median latency minus the direct PD round trip's; "
        "router CPU is per 1,000 requests."
    )


def render(suite: dict[str, Any]) -> str:
    out = [_intro(suite), ""]
    for stream, title in (("no", "Non-streaming"), ("yes", "Streaming (SSE)")):
        header = ["c", "target", "req/s", "p50 ms", "p99 ms"]
        if stream == "yes":
            header += ["TTFT p50 ms", "TTFT p99 ms"]
        header += ["router CPU s / 1k req", "peak RSS MB", "failed", "req/s vs direct"]
        header += ["added p50 ms"]
        out += [f"#### {title}", "", table(header, _rows(suite, stream)), ""]
    out += _paired(suite)
    peers = [t for t in suite["targets"] if is_peer(t)]
    if peers:
        out += ["#### Narwhal relative to each peer (Narwhal ÷ peer; medians)", ""]
        rows = []
        for stream in ("no", "yes"):
            for c in sorted({p["c"] for p in suite["medians"]}):
                n = point(suite, "narwhal", stream, c)
                for peer in peers:
                    q = point(suite, peer, stream, c)
                    if n is None or q is None:
                        continue
                    rows.append(
                        [
                            "stream" if stream == "yes" else "json",
                            str(c),
                            peer,
                            ratio(n["throughput"], q["throughput"]),
                            ratio(n["p50_ms"], q["p50_ms"]),
                            ratio(n["p99_ms"], q["p99_ms"]),
                            ratio(n["ttft_p50_ms"], q["ttft_p50_ms"]) if stream == "yes" else "-",
                            ratio(n["router_cpu_s_per_1k"], q["router_cpu_s_per_1k"]),
                            ratio(n["peak_rss_kb"], q["peak_rss_kb"]),
                        ]
                    )
        header = ["mode", "c", "peer", "req/s", "p50", "p99", "TTFT p50", "CPU / req"]
        header += ["peak RSS"]
        out += [table(header, rows), ""]
    return "\n".join(out)
