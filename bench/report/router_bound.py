"""The router-bound section (bench.suites.router_bound): Narwhal's data-plane workers beside the
peers, the issue 17 §4 targets against vllm-router, the bounded twin (`serving.policy: bounded`
beside `single_attempt`), the edge twins (client keys on, the access log on, beside plain
Narwhal), each process's CPU and memory, and what a 16-core router host would carry."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bench.report.fmt import mb, num, table

BASE = "vllm-router"  # the issue's targets are judged against it, in the same run
RPS_TARGET = 1.0  # Narwhal (workers: auto) req/s ÷ vllm-router's, at least
RPS_INTERIM = 0.8
CPU_TARGET = 1.5  # Narwhal's CPU per request ÷ vllm-router's, at most
HOST_CORES = 16  # the projection's router host
ITL_MS = 20.0  # the projection's streams: one chunk per stream every 20 ms
MODES = {"no": "json", "yes": "stream"}
# edge twin kind -> what is on
EDGE = {
    "auth": "client keys",
    "access": "access log",
    "prefix": "prefix placement",
    "flow": "flow control",
}


def point(suite: dict[str, Any], target: str, stream: str, c: int) -> dict[str, Any] | None:
    return next(
        (
            m
            for m in suite.get("medians", [])
            if m["target"] == target and m["stream"] == stream and m["c"] == c
        ),
        None,
    )


def cells(suite: dict[str, Any]) -> list[tuple[str, int]]:
    return sorted({(m["stream"], m["c"]) for m in suite.get("medians", [])})


def _narwhal(suite: dict[str, Any]) -> list[str]:
    return [t for t in suite.get("targets", []) if t in suite.get("workers", {})]


def _twins(suite: dict[str, Any]) -> dict[str, str]:
    """Every twin (bounded and edge) -> the target it is compared with."""
    return {**suite.get("bounded", {}), **suite.get("edge", {})}


def judged(suite: dict[str, Any]) -> str | None:
    """The Narwhal variant the targets are judged on: `workers: auto` when it ran, else the
    most workers (a sweep without auto); always a plain `single_attempt` one, never a twin."""
    workers: dict[str, str] = suite.get("workers", {})
    twins = _twins(suite)
    ran = [t for t in _narwhal(suite) if t not in twins]
    auto = [t for t in ran if workers[t] == "auto"]
    if auto:
        return auto[0]
    numbered = [t for t in ran if workers[t].isdigit()]
    return max(numbered, key=lambda t: int(workers[t]), default=None)


def label(suite: dict[str, Any], target: str) -> str:
    """`auto (2)`, `2`, `1`: the configured `serving.workers` and, for auto, what it became."""
    configured = suite.get("workers", {}).get(target)
    if configured is None:
        return "-"
    seen = suite.get("worker_processes", {}).get(target, 0)
    if configured == "auto":
        return f"auto ({seen or 1})"
    return str(configured)


def processes(suite: dict[str, Any], target: str) -> int:
    """How many data-plane processes a Narwhal target ran: its workers, or 1 without any."""
    return max(1, int(suite.get("worker_processes", {}).get(target, 0)))


def _value(p: dict[str, Any] | None, key: str) -> float:
    return float(p[key]) if p is not None else math.nan


def _x(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def versus_base(
    suite: dict[str, Any], target: str, stream: str, c: int
) -> tuple[float, float] | None:
    """(req/s ratio, CPU-per-request ratio) of `target` to vllm-router in one cell."""
    p, b = point(suite, target, stream, c), point(suite, BASE, stream, c)
    if p is None or b is None:
        return None
    return (
        _x(_value(p, "throughput"), _value(b, "throughput")),
        _x(_value(p, "router_cpu_s_per_1k"), _value(b, "router_cpu_s_per_1k")),
    )


def target_cells(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cell, the judged Narwhal variant against vllm-router: both ratios and whether each
    target is met, with the requests Narwhal failed there."""
    name = judged(suite)
    if name is None:
        return []
    out = []
    for stream, c in cells(suite):
        got = versus_base(suite, name, stream, c)
        p = point(suite, name, stream, c)
        if got is None or p is None:
            continue
        rps, cpu = got
        out.append(
            {
                "stream": stream,
                "c": c,
                "rps": rps,
                "cpu": cpu,
                "rps_met": rps >= RPS_TARGET,
                "rps_interim": rps >= RPS_INTERIM,
                "cpu_met": cpu <= CPU_TARGET,
                "failed": int(sum(p.get("failed_by", {}).values())),
                "requests": int(p.get("requests", 0)),
            }
        )
    return out


def _verdict(met: bool, interim: bool | None = None) -> str:
    if met:
        return "met"
    if interim:
        return f"**missed** (interim {RPS_INTERIM}x met)"
    return "**missed**"


def _per_cell(suite: dict[str, Any]) -> str:
    rows = []
    for stream, c in cells(suite):
        for target in suite["targets"]:
            p = point(suite, target, stream, c)
            if p is None:
                continue
            got = versus_base(suite, target, stream, c)
            rows.append(
                [
                    MODES[stream],
                    str(c),
                    target,
                    label(suite, target),
                    num(p["throughput"], 0),
                    num(p["p50_ms"], 2),
                    num(p["p99_ms"], 2),
                    num(p["router_cpu_s_per_1k"], 3),
                    mb(p["rss_kb"]),
                    f"{got[0]:.2f}x" if got and not math.isnan(got[0]) else "-",
                    f"{got[1]:.2f}x" if got and not math.isnan(got[1]) else "-",
                    _failed(p),
                    f"{p['client_cpu_util'] * 100:.0f}%",
                ]
            )
    header = [
        "mode",
        "c",
        "target",
        "workers",
        "req/s",
        "p50 ms",
        "p99 ms",
        "router CPU s / 1k req (all processes)",
        "RSS MB (all processes)",
        f"req/s ÷ {BASE}",
        f"CPU / req ÷ {BASE}",
        "failed (all rounds)",
        "load generator CPU",
    ]
    return table(header, rows)


def _failed(p: dict[str, Any]) -> str:
    by = p.get("failed_by", {})
    if not by:
        return "0"
    return ", ".join(f"{k} {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def _targets(suite: dict[str, Any]) -> str:
    name = judged(suite)
    cells = target_cells(suite)
    if name is None or not cells:
        why = "no Narwhal run" if name is None else f"{BASE} did not run"
        return f"Not judged: {why}.\n"
    rows = []
    for t in cells:
        note = f"{t['failed']} of {t['requests']} requests failed" if t["failed"] else "none failed"
        rows.append(
            [
                MODES[t["stream"]],
                str(t["c"]),
                f"{t['rps']:.2f}x",
                _verdict(t["rps_met"], t["rps_interim"]),
                f"{t['cpu']:.2f}x",
                _verdict(t["cpu_met"]),
                note,
            ]
        )
    header = [
        "mode",
        "c",
        f"req/s ÷ {BASE}",
        f"≥ {RPS_TARGET}x (interim {RPS_INTERIM}x)",
        f"CPU / req ÷ {BASE}",
        f"≤ {CPU_TARGET}x",
        f"{name} failures",
    ]
    return (
        f"**{name}** (`serving.workers: {suite['workers'][name]}`, "
        f"{processes(suite, name)} data-plane processes here) against {BASE} in the same "
        "run:\n\n" + table(header, rows) + "\n"
    )


def bounded_cells(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cell and bounded twin: its medians beside its `single_attempt` target's, and the
    ratios bounded ÷ single_attempt of req/s, CPU per request and p50 latency (each a ratio of
    the two medians over the rounds)."""
    out = []
    for stream, c in cells(suite):
        for twin, single in suite.get("bounded", {}).items():
            b, s = point(suite, twin, stream, c), point(suite, single, stream, c)
            if b is None or s is None:
                continue
            out.append(
                {
                    "stream": stream,
                    "c": c,
                    "twin": twin,
                    "single": single,
                    "rps": (_value(s, "throughput"), _value(b, "throughput")),
                    "cpu": (_value(s, "router_cpu_s_per_1k"), _value(b, "router_cpu_s_per_1k")),
                    "p50": (_value(s, "p50_ms"), _value(b, "p50_ms")),
                    "rps_x": _x(_value(b, "throughput"), _value(s, "throughput")),
                    "cpu_x": _x(_value(b, "router_cpu_s_per_1k"), _value(s, "router_cpu_s_per_1k")),
                    "p50_x": _x(_value(b, "p50_ms"), _value(s, "p50_ms")),
                    "failed": (_failed(s), _failed(b)),
                    "reps": min(int(s.get("reps", 0)), int(b.get("reps", 0))),
                }
            )
    return out


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"**{x:.2f}x**"


def _bounded(suite: dict[str, Any]) -> str:
    rows = []
    for t in bounded_cells(suite):
        base = " (`@base`)" if t["single"].endswith("@base") else ""
        rows.append(
            [
                MODES[t["stream"]],
                str(t["c"]),
                label(suite, t["single"]) + base,
                num(t["rps"][0], 0),
                num(t["rps"][1], 0),
                _ratio(t["rps_x"]),
                num(t["cpu"][0], 3),
                num(t["cpu"][1], 3),
                _ratio(t["cpu_x"]),
                f"{num(t['p50'][0], 2)} / {num(t['p50'][1], 2)}",
                f"{t['failed'][0]} / {t['failed'][1]}",
                str(t["reps"]),
            ]
        )
    header = [
        "mode",
        "c",
        "workers",
        "req/s single_attempt",
        "req/s bounded",
        "req/s bounded ÷ single_attempt",
        "CPU s / 1k req single_attempt",
        "CPU s / 1k req bounded",
        "CPU / req bounded ÷ single_attempt",
        "p50 ms single_attempt / bounded",
        "failed single_attempt / bounded",
        "rounds",
    ]
    return table(header, rows)


def edge_kind(target: str) -> str:
    """`auth`, `access`, `prefix` or `flow` for an edge twin's name."""
    kind = target.rpartition("-")[2]
    return kind if kind in EDGE else ""


def edge_cells(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cell and edge twin: its medians beside its plain target's, and the ratios twin ÷
    plain of req/s, CPU per request and p50 latency (each a ratio of the two medians over the
    rounds), with what each wrote to its stderr per request."""
    out = []
    for stream, c in cells(suite):
        for twin, plain in suite.get("edge", {}).items():
            e, p = point(suite, twin, stream, c), point(suite, plain, stream, c)
            if e is None or p is None:
                continue
            out.append(
                {
                    "stream": stream,
                    "c": c,
                    "twin": twin,
                    "kind": edge_kind(twin),
                    "plain": plain,
                    "rps": (_value(p, "throughput"), _value(e, "throughput")),
                    "cpu": (_value(p, "router_cpu_s_per_1k"), _value(e, "router_cpu_s_per_1k")),
                    "p50": (_value(p, "p50_ms"), _value(e, "p50_ms")),
                    "rps_x": _x(_value(e, "throughput"), _value(p, "throughput")),
                    "cpu_x": _x(_value(e, "router_cpu_s_per_1k"), _value(p, "router_cpu_s_per_1k")),
                    "p50_x": _x(_value(e, "p50_ms"), _value(p, "p50_ms")),
                    "log_b": (
                        float(p.get("log_bytes_per_req", math.nan)),
                        float(e.get("log_bytes_per_req", math.nan)),
                    ),
                    "failed": (_failed(p), _failed(e)),
                    "reps": min(int(p.get("reps", 0)), int(e.get("reps", 0))),
                }
            )
    return out


def _edge(suite: dict[str, Any]) -> str:
    rows = []
    for t in edge_cells(suite):
        rows.append(
            [
                MODES[t["stream"]],
                str(t["c"]),
                f"{EDGE.get(t['kind'], t['kind'])} ({t['twin']})",
                num(t["rps"][0], 0),
                num(t["rps"][1], 0),
                _ratio(t["rps_x"]),
                num(t["cpu"][0], 3),
                num(t["cpu"][1], 3),
                _ratio(t["cpu_x"]),
                f"{num(t['p50'][0], 2)} / {num(t['p50'][1], 2)}",
                f"{num(t['log_b'][0], 0)} / {num(t['log_b'][1], 0)}",
                f"{t['failed'][0]} / {t['failed'][1]}",
                str(t["reps"]),
            ]
        )
    plain = next(iter(suite.get("edge", {}).values()), "plain")
    header = [
        "mode",
        "c",
        "on",
        f"req/s {plain}",
        "req/s twin",
        "req/s twin ÷ plain",
        f"CPU s / 1k req {plain}",
        "CPU s / 1k req twin",
        "CPU / req twin ÷ plain",
        "p50 ms plain / twin",
        "stderr bytes / req plain / twin",
        "failed plain / twin",
        "rounds",
    ]
    return table(header, rows)


def _edge_intro(suite: dict[str, Any]) -> str:
    edges = suite.get("edge", {})
    checks = suite.get("edge_checks", {})
    plain = next(iter(edges.values()), "narwhal-wauto")
    parts = [
        f"Narwhal as `{plain}` (`serving.workers: {suite.get('workers', {}).get(plain, 'auto')}`"
        "), configured the same otherwise, ran again with one edge feature on, in the same "
        "rounds and cells, after it in each round's order (`--edge-twins` changes the list, "
        "`none` turns them off). Both sides have the same warm-up and measurement; the ratios "
        "are twin ÷ plain of the medians over the rounds: above 1x, the twin carries more "
        "req/s, spends more router CPU per request, or is slower at p50."
    ]
    for twin in edges:
        kind, check = edge_kind(twin), checks.get(twin, {})
        if kind == "auth":
            refused = check.get("status_without_key")
            seen = (
                f"; a completion sent without it before the runs got {refused}"
                if refused is not None
                else ""
            )
            parts.append(
                f"**{twin}**: `auth: {{api_keys_env: NARWHAL_BENCH_API_KEYS}}`, the bench "
                "setting that variable to one key for the router's process (its workers "
                "inherit it), and the load generator sending `Authorization: Bearer <key>` on "
                "every request to this target only (warm-up included), so each request is "
                f"checked against the key's SHA-256 digest in constant time{seen}."
            )
        elif kind == "prefix":
            parts.append(
                f"**{twin}**: `placement: {{policy: prefix, tokenizers: {{<model>: <the bench "
                "tokenizer>}}`: every prompt tokenized (a word-level `tokenizer.json`, so "
                "cheaper per word than a real model's BPE), keyed in blocks, matched against "
                "the index and its pick shared with the other workers; with one prefill engine "
                "the ranking has one candidate, but every step is paid. The engines publish no "
                "KV events here: the index is Narwhal's own placements."
            )
        elif kind == "flow":
            parts.append(
                f"**{twin}**: `flow: {{enabled: true}}` under `single_attempt`: each request "
                "asks the control process for a start and tells it when each leg is placed and "
                "when it is done (the engines have no `max_concurrency` here, so every ask is "
                "granted at once): the round trip flow control adds when nothing waits."
            )
        elif kind == "access":
            log = check.get("log", f"{twin}.log")
            written = ""
            if check.get("access_lines"):
                written = (
                    f" (at the end: {check['access_lines']:,} access lines, "
                    f"{check.get('log_bytes', 0) / 1e6:.1f} MB, warm-up runs included)"
                )
            parts.append(
                f"**{twin}**: `logging: {{access: true}}`, one JSON line per request written by "
                "each data-plane process to stderr, which is, as for every router here, the "
                f"bench's capture of its output: a regular file, `<results>/work-<mode>/logs/"
                f"{log}`{written}, not a pipe nor /dev/null. The other routers log at warning "
                "level, so write next to nothing per request (the *stderr bytes / req* column)."
            )
    return "\n\n".join(parts)


def _join(parts: dict[str, dict[str, float]], key: str, fmt: Callable[[float], str]) -> str:
    return " · ".join(f"{_short(role)} {fmt(v[key])}" for role, v in parts.items())


def _short(role: str) -> str:
    return f"w{role.split()[1]}" if role.startswith("worker ") else role


def imbalance(p: dict[str, Any]) -> float:
    """The busiest worker's CPU over the idlest's (NaN without two workers)."""
    procs = p.get("procs", {}).items()
    cpu = [float(v["cpu_s_per_1k"]) for r, v in procs if r.startswith("worker ")]
    if len(cpu) < 2 or min(cpu) <= 0:
        return math.nan
    return max(cpu) / min(cpu)


def _processes(suite: dict[str, Any]) -> str:
    rows = []
    for stream, c in cells(suite):
        for target in suite["targets"]:
            p = point(suite, target, stream, c)
            if p is None:
                continue
            procs = p.get("procs", {})
            restarted = ", ".join(p.get("restarted", [])) or "-"
            rows.append(
                [
                    MODES[stream],
                    str(c),
                    target,
                    _join(procs, "cpu_s_per_1k", lambda v: num(v, 3)),
                    _join(procs, "rss_kb", mb),
                    num(imbalance(p), 2) + ("x" if not math.isnan(imbalance(p)) else ""),
                    restarted,
                ]
            )
    header = [
        "mode",
        "c",
        "target",
        "CPU s / 1k req, by process",
        "RSS MB at the end of the run, by process",
        "busiest ÷ idlest worker (CPU)",
        "restarted",
    ]
    return table(header, rows)


def _outcomes(suite: dict[str, Any]) -> list[str]:
    """Narwhal's answers other than `ok`, per cell, from its own counters."""
    lines = []
    for stream, c in cells(suite):
        for target in _narwhal(suite):
            p = point(suite, target, stream, c)
            if p is None:
                continue
            counts = p.get("outcomes", {})
            total = sum(counts.values())
            other = {k: v for k, v in counts.items() if k != "ok"}
            if other and total:
                what = ", ".join(f"`{k}` {v}" for k, v in sorted(other.items()))
                share = sum(other.values()) / total
                lines.append(
                    f"- {MODES[stream]} c={c}, {target}: {what} of {total} answers ({share:.0%})."
                )
    return lines


def project(cpu_s: float, control_s: float, one_process: bool) -> tuple[float, str]:
    """Units per second a `HOST_CORES` host carries at `cpu_s` CPU seconds per unit, of which
    `control_s` in the one control process: the rest scales linearly with cores, the control
    process is capped at one core. A single process (`workers: 1`) is capped at one core."""
    if not cpu_s or math.isnan(cpu_s):
        return math.nan, "-"
    if one_process:
        return 1 / cpu_s, "one process"
    cores = HOST_CORES / cpu_s
    if control_s > 0 and not math.isnan(control_s) and 1 / control_s < cores:
        return 1 / control_s, "the control process (1 core)"
    if control_s > 0 and not math.isnan(control_s):
        return cores, f"{HOST_CORES} cores (control at {cores * control_s:.2f} core)"
    return cores, f"{HOST_CORES} cores"


def _control_share(p: dict[str, Any]) -> float:
    """The control process's part of a Narwhal point's CPU (0 for anything else)."""
    control = p.get("procs", {}).get("control")
    total = float(p["router_cpu_s_per_1k"])
    if control is None or not total or math.isnan(total):
        return 0.0
    return float(control["cpu_s_per_1k"]) / total


def _projection(suite: dict[str, Any]) -> str:
    rows = []
    for target in suite["targets"]:
        workers = suite.get("workers", {}).get(target)
        one = workers is not None and suite.get("worker_processes", {}).get(target, 0) <= 1
        for c in sorted({c for _, c in cells(suite)}):
            j, s = point(suite, target, "no", c), point(suite, target, "yes", c)
            if j is None and s is None:
                continue
            per_req = _value(j, "router_cpu_s_per_1k") / 1000
            share_j = _control_share(j) if j else 0.0
            rps, rps_by = project(per_req, per_req * share_j, one)
            per_chunk = _value(s, "cpu_us_per_chunk") / 1e6
            share_s = _control_share(s) if s else 0.0
            chunks, chunks_by = project(per_chunk, per_chunk * share_s, one)
            streams = chunks * ITL_MS / 1000
            failed = [MODES[m] for m, p in (("no", j), ("yes", s)) if p and p["failed"]]
            rows.append(
                [
                    target,
                    label(suite, target),
                    str(c),
                    num(per_req * 1000, 3),
                    f"{share_j:.1%}" if share_j else "-",
                    num(rps, 0),
                    rps_by,
                    num(per_chunk * 1e6, 1),
                    f"{share_s:.1%}" if share_s else "-",
                    num(streams, 0),
                    chunks_by,
                    ", ".join(failed) + " had failures" if failed else "",
                ]
            )
    header = [
        "target",
        "workers",
        "from c",
        "CPU ms / req",
        "control's part",
        f"req/s on {HOST_CORES} cores",
        "bound by",
        "CPU µs / streamed chunk",
        "control's part",
        f"streams at {ITL_MS:.0f} ms ITL",
        "bound by",
        "note",
    ]
    return table(header, rows)


def _intro(suite: dict[str, Any]) -> str:
    cs = " and ".join(f"c={c}" for c in suite["concurrency"])
    twins = _twins(suite)
    sweep = ", ".join(w for t, w in suite.get("workers", {}).items() if t not in twins) or "none"
    return (
        f"One prefill and one decode sim answering at once (no inter-token latency, no TTFT "
        f"delay), prompts of {suite['prompt_words']} words (the first half the same in every "
        f"request, then the request's own), `max_tokens` {suite['max_tokens']} "
        f"(a stream is {suite['max_tokens']} events and `[DONE]`), {cs}, non-streaming then "
        f"streaming; {suite['reps']} round(s) of {suite['run_s']:.1f} s per target, each after "
        "its own warm-up run (4 requests per client, outside the measurement), targets in a "
        "rotated order each round; medians shown. Narwhal runs once per `serving.workers` value "
        f"({sweep}; `--workers-sweep` changes the list), with its defaults otherwise except "
        f"`max_connections` {suite.get('max_connections', 256)} (sized for c=256: a request can "
        "hold a socket to each engine at once; at the default 256 the c=256 cells measure the "
        "bound, "
        "docs/dataplane.md), policy `single_attempt` (the bounded and edge twins aside, "
        "below) and `placement.policy: least_loaded` (the default, `prefix`, is the prefix "
        "twin); `auto` "
        "is the usable CPUs, "
        f"{suite.get('usable_cpus', '?')} here. Router CPU is utime + stime of every process of "
        "the router (the process started and its descendants: for Narwhal with workers the "
        "control process and its worker children), from /proc before and after the measured "
        "run, per 1,000 answered requests (ok or failed); RSS is each process's VmRSS at the end "
        "of the run. The load generator's CPU is a share of one core: near 100% it, not the "
        f"router, is the limit. The suite took {suite.get('wall_s', 0):.0f} s."
    )


def _twin_intro(suite: dict[str, Any]) -> str:
    twins = suite.get("bounded", {})
    workers = suite.get("workers", {})
    values = ", ".join(dict.fromkeys(f"`{workers[t]}`" for t in twins if t in workers))
    modes = " and ".join(MODES[m] for m in suite.get("bounded_streams", ["no", "yes"]))
    return (
        f"Narwhal with `serving.workers` {values} ran a second time under `serving.policy: "
        "bounded` (`narwhal-w<N>-bounded`, configured the same otherwise), in the same rounds "
        f"and cells ({modes}), after its `single_attempt` run in each round's order "
        "(`--bounded-twin` changes the list, `none` turns it off). Under `bounded` a stream "
        "that may migrate, every stream here, is relayed event by event through the migration "
        "splice (`Splice`, src/narwhal/dataplane/migration.py) rather than as raw bytes, and "
        "asks the engines for token ids (`return_token_ids`), so the decode's events are "
        "longer; a non-streaming request differs only in waiting for a data connection "
        "instead of a `saturated` 503 and in its retry budget, neither used when nothing "
        "fails. The ratios are bounded ÷ single_attempt of the medians over the rounds: "
        "above 1x, bounded carries more req/s, spends more router CPU per request, or is "
        "slower at p50."
    )


_SATURATION = (
    "`saturated` is Narwhal's 503 when every data connection of the router is in use "
    "(`serving.max_connections`, one bound shared by the workers) and the `single_attempt` "
    "policy does not queue. A refused request comes back at once and the closed loop sends the "
    "next, so the counts grow with the run's length; cheap 503s also lower that cell's CPU per "
    "answered request."
)


def render(suite: dict[str, Any]) -> str:
    out = [
        _intro(suite),
        "",
        "#### Per cell",
        "",
        _per_cell(suite),
        "",
        f"#### Issue 17 §4 targets against {BASE}",
        "",
        _targets(suite),
    ]
    if bounded_cells(suite):
        out += [
            "#### Bounded twin: `serving.policy: bounded` ÷ `single_attempt`",
            "",
            _twin_intro(suite),
            "",
            _bounded(suite),
            "",
        ]
    if edge_cells(suite):
        out += [
            "#### Edge twins: one feature on ÷ plain",
            "",
            _edge_intro(suite),
            "",
            _edge(suite),
            "",
        ]
    out += [
        "#### Per process",
        "",
        "Each process's CPU per 1,000 requests and its RSS (medians over the rounds; `wK` is "
        "data-plane worker K). The busiest ÷ idlest column shows how evenly the kernel spread "
        "the connections over the workers.",
        "",
        _processes(suite),
        "",
    ]
    outcomes = _outcomes(suite)
    if outcomes:
        out += [
            "#### Narwhal's answers other than ok",
            "",
            "From `narwhal_requests_total` (read from `/metrics` around each run), summed over "
            "the rounds.",
            "",
            *outcomes,
            "",
            _SATURATION,
            "",
        ]
    out += [
        f"#### Projection: one {HOST_CORES}-core router host",
        "",
        f"From the CPU per request (non-streaming) and per streamed chunk (streaming) measured "
        f"above: requests/s, and concurrent streams at {ITL_MS:.0f} ms inter-token latency "
        f"({1000 / ITL_MS:.0f} chunks/s each), that a host running only the router would carry. "
        "Assumptions: the workers' CPU per request stays as measured and scales linearly with "
        f"cores ({HOST_CORES} workers); the control process's part is measured here and stays "
        "per request as measured, but it is one process, so it caps the host at one core of "
        "its own work (*bound by*); `workers: 1` is one process, capped at one core whatever "
        "the host; the peers are taken to scale linearly over their threads. CPU per chunk is "
        f"the streaming run's CPU over its events, so it carries each request's set-up spread "
        f"over only {suite['max_tokens']} events: longer streams cost less per chunk, and the "
        "streams column is a lower bound. Cells with failures (`saturated` 503s, above) "
        "understate the CPU per request and overstate the projection.",
        "",
        _projection(suite),
        "",
    ]
    return "\n".join(out)


def behind(suite: dict[str, Any]) -> list[str]:
    """For *Where Narwhal is behind*: the cells where the judged variant misses a target, and
    the cells where a Narwhal variant refused requests."""
    name = judged(suite)
    out = []
    for t in target_cells(suite):
        cell = f"{MODES[t['stream']]} c={t['c']}"
        if not t["rps_met"]:
            out.append(
                f"{cell}: {name} carries {t['rps']:.2f}x {BASE}'s req/s (target "
                f"{RPS_TARGET}x, interim {RPS_INTERIM}x)."
            )
        if not t["cpu_met"]:
            out.append(
                f"{cell}: {name} spends {t['cpu']:.2f}x {BASE}'s CPU per request (target at "
                f"most {CPU_TARGET}x)."
            )
    for stream, c in cells(suite):
        for target in _narwhal(suite):
            p = point(suite, target, stream, c)
            sat = (p or {}).get("outcomes", {}).get("saturated", 0)
            if sat:
                out.append(
                    f"{MODES[stream]} c={c}: {target} refused {sat} requests as `saturated` "
                    "(every data connection in use)."
                )
    return out
