"""Where Narwhal is behind, from this run's numbers, and why (with the profile's top costs)."""

from __future__ import annotations

from typing import Any

from bench.context import PEER_KINDS
from bench.report import profile, router_bound, router_wrk
from bench.report.fmt import is_peer
from bench.report.overhead import paired_added, point

BEHIND = 0.05  # report gaps over 5 %


def _overhead(o: dict[str, Any]) -> list[str]:
    out = []
    peers = [t for t in o.get("targets", []) if is_peer(t)]
    cs = sorted({p["c"] for p in o.get("medians", [])})
    for stream, label in (("no", "non-streaming"), ("yes", "streaming")):
        for peer in peers:
            slower, cpu = [], []
            for c in cs:
                n, q = point(o, "narwhal", stream, c), point(o, peer, stream, c)
                if not n or not q:
                    continue
                if n["throughput"] < q["throughput"] * (1 - BEHIND):
                    slower.append(f"c={c}: {n['throughput']:.0f} vs {q['throughput']:.0f}")
                if q["router_cpu_s_per_1k"] > 0:
                    cpu.append(n["router_cpu_s_per_1k"] / q["router_cpu_s_per_1k"])
            if slower:
                out.append(f"Throughput, {label}, below {peer} (req/s): " + "; ".join(slower) + ".")
            if cpu and max(cpu) > 1 + BEHIND:
                out.append(
                    f"CPU per request, {label}: {min(cpu):.1f}-{max(cpu):.1f}x {peer}'s "
                    "(all concurrencies)."
                )
    return out


def _streams(s: dict[str, Any]) -> list[str]:
    rows = {r["target"]: r for r in s.get("rows", [])}
    n = rows.get("narwhal")
    if not n:
        return []
    out = []
    for peer, q in rows.items():
        if not is_peer(peer):
            continue
        if n["steady_chunks_per_s"] < q["steady_chunks_per_s"] * (1 - BEHIND):
            out.append(
                f"{s['streams']} streams: {n['steady_chunks_per_s']:.0f} chunks/s delivered vs "
                f"{q['steady_chunks_per_s']:.0f} through {peer}."
            )
        if q["cpu_us_per_chunk"] and n["cpu_us_per_chunk"] > q["cpu_us_per_chunk"] * 1.05:
            out.append(
                f"{s['streams']} streams: {n['cpu_us_per_chunk']:.0f} µs of router CPU per chunk "
                f"vs {q['cpu_us_per_chunk']:.0f} µs for {peer}."
            )
    return out


def _faults(f: dict[str, Any]) -> list[str]:
    rows = f.get("rows", [])
    out = []
    for r in rows:
        if not r["router"].startswith("narwhal"):
            continue
        better = [
            p
            for p in rows
            if p["scenario"] == r["scenario"]
            and not p["router"].startswith("narwhal")
            and p["failed"] < r["failed"]
        ]
        if better:
            names = ", ".join(f"{p['router']} {p['failed']}" for p in better)
            out.append(
                f"{r['scenario']}: {r['router']} failed {r['failed']} requests; fewer: {names}."
            )
        if r["out_of_rotation_s"] is None:
            out.append(
                f"{r['scenario']}: {r['router']} kept sending client requests to the faulty "
                f"engine until the end of the fault ({r['at_engine_during_fault']} requests)."
            )
    return out


def _control(c: dict[str, Any], interval_s: float) -> list[str]:
    rows = c.get("rows", [])
    if not rows:
        return []
    r = max(rows, key=lambda x: x["engines"])
    share = r["pass_wall_ms"] / (interval_s * 1000)
    if share < 0.25:
        return []
    stages = sorted(r["stage_ms"].items(), key=lambda kv: -kv[1])[:3]
    top = ", ".join(f"{k} {v:.0f} ms" for k, v in stages)
    return [
        f"At {r['engines']} engines one monitor pass takes {r['pass_wall_ms']:.0f} ms of wall "
        f"time ({share:.0%} of the {interval_s:.0f} s interval; {top}) and "
        f"{r['cpu_ms_per_pass']:.0f} ms of CPU: the health stage probes every engine over "
        "the control pool, and the telemetry stage sets about a dozen labelled gauges per "
        "engine on every pass. The control pool's bound (`engine.control_connections`, 8 by "
        "default) counts idle keep-alive sockets too, so with more engines than control "
        "connections most health checks open a fresh connection: the price of keeping the "
        "bound the spec sets (a larger `control_connections` buys the sockets back)."
    ]


def _why_latency(o: dict[str, Any]) -> str:
    added, floor = paired_added(o, "narwhal"), paired_added(o, "floor")
    if added is None or floor is None:
        return ""
    peer = paired_added(o, "vllm-router")
    rust = f" (vllm-router, in Rust, adds {peer:.2f} ms in the same run)" if peer else ""
    verdict = (
        "The floor alone is at or over the 1 ms target: on this machine no router on this "
        "stack can meet it, and Narwhal's own work is what is left to cut."
        if floor >= 1
        else "Narwhal's own work is what puts it over the target."
    )
    return (
        f"Latency at c=1: in the paired run Narwhal adds {added:.2f} ms over the direct PD round "
        f"trip, and the floor (`bench/floor.py`: the same aiohttp stack relaying both legs with "
        f"no logic at all) adds {floor:.2f} ms: one more HTTP hop in Python, with its two "
        f"process wake-ups over loopback{rust}. Narwhal's own work — validating the body, "
        "placement, deadlines, handoff validation, evidence and metrics — is the remaining "
        f"{added - floor:.2f} ms; at c=1 the process sleeps between requests, so all of that "
        f"code runs with cold caches, several times slower than under load. {verdict}"
    )


def _why_streams(s: dict[str, Any]) -> str:
    rows = {r["target"]: r for r in s.get("rows", [])}
    n = rows.get("narwhal")
    if not n or not n["cpu_us_per_chunk"]:
        return ""
    capacity = 1e6 / n["cpu_us_per_chunk"]
    needed = s["streams"] * 1000 / s["itl_ms"]
    direct = rows.get("direct", {}).get("gap_ms", {}).get("p99")
    versus = f" vs {direct:.0f} ms direct" if direct else ""
    load = (
        f"so the router is busy about {needed / capacity:.0%} of one core's time and a "
        f"stream's events wait behind the others' (gap p99 {n['gap_ms'].get('p99', 0):.0f} ms"
        f"{versus})"
    )
    return (
        f"Many streams: Narwhal spends {n['cpu_us_per_chunk']:.0f} µs of CPU per chunk over all "
        f"its processes (with `serving.workers: auto` a control process and one data-plane "
        f"worker per core, each on its own event loop), so one core carries at most about "
        f"{capacity:,.0f} chunks/s; {s['streams']} streams at {s['itl_ms']:.0f} ms need "
        f"{needed:,.0f}/s, {load}. The Rust peers also spread the "
        "work over both cores. Memory: each open stream holds an "
        "aiohttp server request and `StreamResponse`, an upstream connection of "
        "`engine/h1.py` with its parser and buffered pieces, the handler task and its "
        "coroutine frames; "
        f"{n['memory_per_stream_kb'] or 0:.0f} KB per stream here against the target's 20 KB "
        "(the peers, which keep larger pools and caches, use more in total)."
        + _why_floor(n, rows.get("floor"))
        + _why_memory(s.get("attribution"))
    )


def _why_floor(n: dict[str, Any], floor: dict[str, Any] | None) -> str:
    if not floor or not floor.get("memory_per_stream_kb") or not floor.get("cpu_us_per_chunk"):
        return ""
    kb = (n["memory_per_stream_kb"] or 0) - floor["memory_per_stream_kb"]
    us = n["cpu_us_per_chunk"] - floor["cpu_us_per_chunk"]
    return (
        f" The floor (the same stack relaying the stream with no logic) holds "
        f"{floor['memory_per_stream_kb']:.1f} KB per stream and spends "
        f"{floor['cpu_us_per_chunk']:.0f} µs of CPU per chunk in the same run; Narwhal's "
        f"deadlines, SSE checks, evidence and metrics come to {kb:+.1f} KB and {us:+.0f} µs "
        "beside it (a difference near zero is within this measurement's noise)."
    )


def _why_memory(a: dict[str, Any] | None) -> str:
    if not a:
        return ""
    top = a["modules"][:4]
    named = ", ".join(f"`{m['module']}` {m['kb_per_stream']:.1f} KB" for m in top)
    listed = a["modules"]
    stacks = sum(
        m["kb_per_stream"] for m in listed if m["module"].startswith(("aiohttp/", "asyncio/"))
    )
    mine = sum(m["kb_per_stream"] for m in listed if m["module"].startswith("narwhal/"))
    return (
        f" Measured with tracemalloc, the open streams hold {a['traced_kb_per_stream']:.1f} KB "
        f"of Python objects each; the largest: {named}. aiohttp and asyncio account for "
        f"{stacks:.1f} KB of it (aiohttp's server connection and request, two transports), "
        f"Narwhal's own modules {mine:.1f} KB (the request path's coroutine frames and the "
        "engine connection of `engine/h1.py`)."
    )


def _why_faults(f: dict[str, Any], o: dict[str, Any]) -> str:
    if not _faults(f):
        return ""
    fixed = (
        "sglang-router retries a failed request on another worker (5 attempts by default, 5xx "
        "answers included) and trips a circuit breaker on failures, so its clients rarely see "
        "an error; its breaker then keeps the engine out for 60 s by default, hence 'not "
        "within' in the *back* column. A frozen engine's open streams fail after "
        "`serving.stream_idle_timeout_s` (5 s, the fault's length here), where routers without "
        "an idle deadline simply wait for the thaw. Narwhal's *back* times come from "
        "readmission's backoff (the monitor interval doubled per failed attempt, jittered), "
        "which keeps retrying an ejected engine while the fault lasts."
    )
    return _buffering(o) + _midstream(f) + fixed


def _midstream(f: dict[str, Any]) -> str:
    """How many of Narwhal's failures came after the first byte, where no retry is allowed."""
    out = []
    for policy in ("narwhal", "narwhal-bounded"):
        mine = [r for r in f.get("rows", []) if r["router"] == policy and r["failed"]]
        failed = sum(r["failed"] for r in mine)
        mid = sum(r.get("failed_midstream", 0) for r in mine)
        if failed:
            out.append(f"{mid} of {policy}'s {failed}")
    if not out:
        return ""
    return (
        "Of the failures across all scenarios, " + " and ".join(out) + " came after the "
        "response's first byte had reached the client (the *after first byte* column): a stream "
        "cut by a dead or frozen engine, which DESIGN §1 forbids retrying under either policy. "
        "The others met the fault before any byte was sent: `single_attempt` answers those with "
        "an error by definition, `bounded` retries them on another pair within the deadline. "
    )


def _buffering(o: dict[str, Any]) -> str:
    """A router whose first streamed byte comes almost at the end relays streams nearly whole."""
    out = []
    for peer in [t for t in o.get("targets", []) if is_peer(t)]:
        q = point(o, peer, "yes", 1)
        if q and q["ttft_p50_ms"] > 0.8 * q["p50_ms"]:
            out.append(
                f"{peer} delivers a stream's first byte only "
                f"{q['p50_ms'] - q['ttft_p50_ms']:.1f} ms before its end at c=1 (TTFT p50 "
                f"{q['ttft_p50_ms']:.2f} vs {q['p50_ms']:.2f} ms in the overhead table): it "
                "relays streams almost whole, so when a decode engine dies mid-stream its "
                "client has usually received nothing yet, and nothing forbids a retry. "
            )
    return "Faults: " + "".join(out) if out else "Faults: "


def _why(p: dict[str, Any]) -> str:
    w = (p.get("targets") or {}).get("narwhal-wauto", {}).get("json")
    if not w:
        return ""
    top = ", ".join(f"{name} {us:.0f}" for name, us in profile.step_totals(w)[:7])
    return (
        "Profiled under wrk in front of engines that answer at once, with Narwhal's defaults "
        "(`workers: auto`) but placement by load (`least_loaded`; the default, `prefix`, is "
        f"`narwhal-wauto-prefix`): non-streaming, {w['cpu_us_per_request']:.0f} CPU-µs per request "
        "over all its processes; the largest steps, in µs per request: "
        f"{top} (the profile section has each process's split). The peers are Rust (tokio "
        "and hyper) with worker threads on both cores."
    )


def render(doc: dict[str, Any]) -> str:
    suites = doc["suites"]
    sections = [
        ("Overhead", _overhead(suites.get("overhead") or {})),
        ("Many streams", _streams(suites.get("streams") or {})),
        ("Faults", _faults(suites.get("faults") or {})),
        ("Control plane", _control(suites.get("control") or {}, 1.0)),
        ("Router-bound, with workers", router_bound.behind(suites.get("router_bound") or {})),
        ("Router-bound, under wrk", router_wrk.behind(suites.get("router_wrk") or {})),
    ]
    out = []
    for title, items in sections:
        if items:
            out += [f"**{title}**", "", *[f"- {x}" for x in items], ""]
    if not out and not set(PEER_KINDS) <= set(doc.get("skipped", {})):
        out = ["Narwhal was not behind any peer by more than 5% on any measured figure.", ""]
    elif not out:
        out = ["No peer router ran, so nothing was compared.", ""]
    why = [
        _why(suites.get("profile") or {}),
        _why_streams(suites.get("streams") or {}),
        _why_latency(suites.get("overhead") or {}),
        _why_faults(suites.get("faults") or {}, suites.get("overhead") or {}),
    ]
    if any(why):
        out += ["**Why**", ""]
        for text in why:
            if text:
                out += [text, ""]
    return "\n".join(out)
