"""The router_wrk section (bench.suites.router_wrk): each router's CPU per request under wrk in
front of mock engines that answer at once, the engines' and wrk's beside it, and each Narwhal
target's CPU per request as a ratio to vllm-router's and sglang-router's."""

from __future__ import annotations

import math
import shlex
from typing import Any

from bench.report.fmt import num, table
from bench.report.router_bound import MODES, point
from bench.report.router_bound import cells as _cells
from bench.stats import median

PEERS = ("vllm-router", "sglang-router")


def narwhal_targets(suite: dict[str, Any]) -> list[str]:
    return [t for t in suite.get("targets", []) if t.startswith("narwhal")]


def cpu_ratio(suite: dict[str, Any], target: str, peer: str, stream: str, c: int) -> float:
    """`target`'s router CPU per request ÷ `peer`'s in one cell (NaN when either is missing,
    zero, or broken in any round)."""
    a, b = point(suite, target, stream, c), point(suite, peer, stream, c)
    if a is None or b is None or a["broken_runs"] or b["broken_runs"]:
        return math.nan
    x, y = float(a["router_cpu_ms_per_1k"]), float(b["router_cpu_ms_per_1k"])
    return x / y if y and not math.isnan(x) and not math.isnan(y) else math.nan


INTERIM = 1.5  # issue 32: CPU per request at most 1.5x the cheaper peer's for now
FLOOR = "floor-raw"
FLOOR_TARGET = 1.5  # issue 32: at most 1.5x the raw floor's


def against(suite: dict[str, Any], target: str, others: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per cell, `target`'s CPU per request ÷ the cheapest of `others` that ran there (the
    harder comparison), with that one's name; cells where none ran are left out."""
    out = []
    for stream, c in _cells(suite):
        ratios = [(cpu_ratio(suite, target, o, stream, c), o) for o in others]
        ratios = [(x, o) for x, o in ratios if not math.isnan(x)]
        if point(suite, target, stream, c) is None or not ratios:
            continue
        x, o = max(ratios)  # the largest ratio is against the cheapest router
        out.append({"stream": stream, "c": c, "ratio": x, "vs": o})
    return out


def behind(suite: dict[str, Any]) -> list[str]:
    """For *Where Narwhal is behind*: each cell where a Narwhal target spends more CPU per
    request under wrk than the cheaper peer, or more than 1.5x the raw floor's."""
    out = []
    for target in narwhal_targets(suite):
        for t in against(suite, target, PEERS):
            if t["ratio"] > 1:
                out.append(
                    f"{MODES[t['stream']]} c={t['c']} under wrk: {target} spends "
                    f"{t['ratio']:.2f}x {t['vs']}'s CPU per request."
                )
        for t in against(suite, target, (FLOOR,)):
            if t["ratio"] > FLOOR_TARGET:
                out.append(
                    f"{MODES[t['stream']]} c={t['c']} under wrk: {target} spends "
                    f"{t['ratio']:.2f}x {FLOOR}'s CPU per request (target {FLOOR_TARGET}x)."
                )
    return out


def _x(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.2f}x"


def _procs(p: dict[str, Any]) -> str:
    """`control 20, w0 240, w1 235`: each process's median CPU-ms per 1,000 requests."""
    procs = p.get("procs", {})
    if len(procs) <= 1:
        return "-"
    return ", ".join(f"{role.replace('worker ', 'w')} {num(v, 0)}" for role, v in procs.items())


def failures(p: dict[str, Any]) -> str:
    """What went wrong over the rounds: broken runs first (most requests failed), then error
    statuses and socket errors; `0` when nothing did."""
    parts = []
    if p.get("broken_runs"):
        parts.append(f"**{p['broken_runs']} of {p['reps']} runs broken**")
    if p.get("non_2xx"):
        parts.append(f"{p['non_2xx']} non-2xx of {p['requests']}")
    parts += [f"{kind} {n}" for kind, n in sorted(p.get("socket_errors", {}).items())]
    return ", ".join(parts) or "0"


def _table(suite: dict[str, Any]) -> str:
    rows = []
    for stream, c in _cells(suite):
        for target in suite["targets"]:
            p = point(suite, target, stream, c)
            if p is None:
                continue
            rows.append(
                [
                    MODES[stream],
                    str(c),
                    target,
                    num(p["rps"], 0),
                    num(p["p50_ms"], 2),
                    num(p["p99_ms"], 2),
                    num(p["router_cpu_ms_per_1k"], 0),
                    _procs(p),
                    num(p["engines_cpu_ms_per_1k"], 0),
                    f"{num(p['prefill_cpu_ms_per_1k'], 0)} / {num(p['decode_cpu_ms_per_1k'], 0)}",
                    num(p["wrk_cpu_ms_per_1k"], 0),
                    failures(p),
                ]
            )
    header = [
        "mode",
        "c",
        "target",
        "req/s",
        "p50 ms",
        "p99 ms",
        "router CPU-ms / 1k req (all processes)",
        "per process",
        "engines CPU-ms / 1k",
        "prefill / decode",
        "wrk CPU-ms / 1k",
        "failed (all rounds)",
    ]
    return table(header, rows)


def _ratios(suite: dict[str, Any]) -> str:
    peers = [p for p in PEERS if p in suite.get("targets", [])]
    narwhal = narwhal_targets(suite)
    if not peers or not narwhal:
        why = "no Narwhal target ran" if not narwhal else "no peer ran"
        return f"No ratios: {why}."
    rows = []
    for stream, c in _cells(suite):
        for target in narwhal:
            if point(suite, target, stream, c) is None:
                continue
            rows.append(
                [MODES[stream], str(c), target]
                + [_x(cpu_ratio(suite, target, peer, stream, c)) for peer in peers]
            )
    return table(["mode", "c", "Narwhal target", *(f"CPU / req ÷ {p}" for p in peers)], rows)


def asked(p: dict[str, Any], role: str) -> str:
    """`completions prefill 1.00, tokenize 404 1.00`: what the router asked of one engine per
    client request (kinds under 0.01 per request, e.g. health checks, left out)."""
    kinds = p.get("engine_requests_per_req", {}).get(role, {})
    parts = [
        f"{key.removeprefix('/').removeprefix('v1/')} {n:.2f}"
        for key, n in sorted(kinds.items())
        if n >= 0.01
    ]
    return ", ".join(parts) or "-"


def _asked(suite: dict[str, Any]) -> str:
    rows = []
    for stream, c in _cells(suite):
        for target in suite["targets"]:
            p = point(suite, target, stream, c)
            if p is not None:
                cells = [asked(p, "prefill"), asked(p, "decode")]
                rows.append([MODES[stream], str(c), target, *cells])
    return table(["mode", "c", "target", "prefill engine", "decode engine"], rows)


def ab_pairs(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """`--ab-src`: per Narwhal target with an `@base` twin and per cell, the ratio of the
    target's router CPU per request to its twin's in each round (the two ran in the same
    round, so a pair shares the machine's state of the moment), their median, and how many
    are below 1. Broken runs make no pair."""
    samples = suite.get("samples", [])
    by = {(r["target"], r["stream"], r["c"], r["rep"]): r for r in samples if not r["broken"]}
    out = []
    for target in narwhal_targets(suite):
        if target.endswith("@base") or f"{target}@base" not in suite.get("targets", []):
            continue
        for stream, c in _cells(suite):
            ratios = []
            for (t, st, cc, rep), r in sorted(by.items()):
                twin = by.get((f"{target}@base", st, cc, rep))
                if (t, st, cc) == (target, stream, c) and twin is not None:
                    ratios.append(_ratio(r["router_cpu_ms_per_1k"], twin["router_cpu_ms_per_1k"]))
            ratios = [x for x in ratios if not math.isnan(x)]
            if ratios:
                out.append(
                    {
                        "target": target,
                        "stream": stream,
                        "c": c,
                        "median": median(ratios),
                        "below_1": sum(1 for x in ratios if x < 1),
                        "ratios": ratios,
                    }
                )
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _ab(suite: dict[str, Any]) -> str:
    rows = [
        [
            p["target"],
            MODES[p["stream"]],
            str(p["c"]),
            f"{p['median']:.2f}x",
            f"{p['below_1']} of {len(p['ratios'])}",
            ", ".join(f"{x:.2f}" for x in p["ratios"]),
        ]
        for p in ab_pairs(suite)
    ]
    return table(
        ["target", "mode", "c", "CPU/request ÷ @base (median)", "pairs below 1", "pairs"], rows
    )


def _regression(found: dict[str, Any] | None) -> str:
    """`bench/regression.py`'s verdict on this run (made by `python -m bench` after the run)."""
    if found is None:
        return "Not checked (an A/B run, or a baseline recorded by this run)."
    if found["ok"] is None:
        return f"Not checked: {found['why']}."
    head = ("**Regressed**" if not found["ok"] else "Within the noise") + (
        f" against the run recorded {found['baseline_recorded_at']} "
        "(`bench/baselines/router_wrk.json`): each Narwhal cell's CPU per request as a ratio "
        "to floor-raw's in the same rounds (median of rounds), allowed to rise by the larger "
        "of 10% and either run's spread of that ratio."
    )
    return "\n".join([head, "", *[f"- {line}" for line in found["compared"]]])


def render(suite: dict[str, Any]) -> str:
    if suite.get("skipped"):
        return f"Not run: {suite['skipped']}."
    w = suite.get("wrk", {})
    cs = ", ".join(str(c) for c in suite.get("concurrency", []))
    intro = (
        f"wrk (`{w.get('version', 'wrk')}`, one thread, c={cs}) sends the same completion "
        f"(`max_tokens` {suite['max_tokens']}, a {suite['prompt_words']}-word prompt) to each "
        "router in front of one prefill and one decode `bench.mock_engine` (aiohttp, answers at "
        f"once), {suite['run_s']:.0f} s per run after a {suite['warm_s']:.0f} s warm-up, every "
        f"target once per round in a rotated order, medians over {suite['reps']} round(s); CPU is "
        "utime + stime from /proc over every process of the router's tree, of the two engines "
        "and of wrk, per 1,000 requests wrk completed. A run where most requests failed is "
        "counted as broken, and its cell gets no ratio."
    )
    out = [
        intro,
        "",
        "```sh",
        shlex.join(w.get("argv", ["wrk"])),
        "```",
        "",
        _table(suite),
        "",
        "#### Narwhal's CPU per request ÷ each peer's",
        "",
        _ratios(suite),
        "",
        "#### What each router asked of the engines, per client request",
        "",
        "From the mock engines' own counts (`/mock/stats`), by path and kind: `prefill` (a "
        "leg with `do_remote_decode`), `json` or `stream` (any other completion), `404` (an "
        "endpoint the mock does not serve, as an engine without it answers), `get` (probes).",
        "",
        _asked(suite),
    ]
    out += ["", "#### Against the last recorded run", "", _regression(suite.get("regression"))]
    if ab_pairs(suite):
        out += [
            "",
            "#### A/B: each Narwhal target against its `@base` twin (`--ab-src`), round by round",
            "",
            _ab(suite),
        ]
    return "\n".join(out)
