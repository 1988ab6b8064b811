"""The overhead section: one table per stream mode, then Narwhal's ratios to each peer."""

from __future__ import annotations

from typing import Any

from bench.report.fmt import mb, num, ratio, table


def point(suite: dict[str, Any], target: str, stream: str, c: int) -> dict[str, Any] | None:
    for p in suite["medians"]:
        if p["target"] == target and p["stream"] == stream and p["c"] == c:
            return dict(p)
    return None


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
    peers = [t for t in suite["targets"] if t not in ("direct", "narwhal")]
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
