"""The targets, judged against the same run: met, or missed by how much."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.report import router_bound as rb
from bench.report import router_wrk as rw
from bench.report.fmt import table
from bench.report.overhead import paired_added, point

PEERS = ("vllm-router", "sglang-router")


@dataclass(frozen=True, slots=True)
class Verdict:
    target: str
    measured: str
    met: bool | None  # None: not measured in this run

    def row(self) -> list[str]:
        status = {True: "met", False: "**missed**", None: "not measured"}[self.met]
        return [self.target, self.measured, status]


def throughput(suites: dict[str, Any]) -> Verdict:
    name = "Non-streaming throughput at c=64 through Narwhal ≥ vllm-router's"
    o = suites.get("overhead") or {}
    n = point(o, "narwhal", "no", 64) if o else None
    v = point(o, "vllm-router", "no", 64) if o else None
    if not n or not v:
        return Verdict(name, "-", None)
    gap = n["throughput"] / v["throughput"] - 1
    text = f"{n['throughput']:.0f} vs {v['throughput']:.0f} req/s ({gap:+.0%})"
    return Verdict(name, text, gap >= 0)


def added_latency(suites: dict[str, Any]) -> Verdict:
    name = "Added p50 latency over the direct PD round trip at c=1 < 1 ms"
    o = suites.get("overhead") or {}
    added = paired_added(o, "narwhal") if o else None
    if added is not None:
        text = f"+{added:.2f} ms (non-streaming, paired run)"
    else:
        n = point(o, "narwhal", "no", 1) if o else None
        d = point(o, "direct", "no", 1) if o else None
        if not n or not d:
            return Verdict(name, "-", None)
        added = n["p50_ms"] - d["p50_ms"]
        text = f"+{added:.2f} ms ({n['p50_ms']:.2f} vs {d['p50_ms']:.2f} ms, non-streaming)"
    if added >= 1:
        text += f"; over by {added - 1:.2f} ms"
    floor = paired_added(o, "floor")
    if floor is not None:
        text += f"; the HTTP stack's floor adds +{floor:.2f} ms of it"
    return Verdict(name, text, added < 1)


def streams(suites: dict[str, Any]) -> Verdict:
    s = suites.get("streams") or {}
    rows = [r for r in s.get("rows", []) if r["target"] == "narwhal"]
    name = "At 1,000 concurrent streams: ≤ 20 KB router memory per stream, no stalls"
    if not rows:
        return Verdict(name, "-", None)
    r = rows[0]
    kb = r["memory_per_stream_kb"] or 0.0
    clean = r["stalls"] == 0 and r["failed"] == 0 and r["hung"] == 0
    text = (
        f"{kb:.1f} KB/stream, {r['stalls']} stalls, {r['failed']} failed, {r['hung']} hung "
        f"at {r['peak_in_flight']} streams"
    )
    if kb > 20:
        text += f"; memory over by {kb - 20:.1f} KB ({kb / 20 - 1:.0%})"
    floor = next((r for r in s.get("rows", []) if r["target"] == "floor"), None)
    if floor is not None and floor.get("memory_per_stream_kb") is not None:
        text += f"; the HTTP stack's floor holds {floor['memory_per_stream_kb']:.1f} KB/stream"
    met = kb <= 20 and clean if s["streams"] >= 1000 else None
    return Verdict(name, text, met)


# One aiohttp process before issue 17: router CPU per streamed chunk at 1,000 streams
# (docs/performance-log.md, "Data-plane workers").
BASE_US_PER_CHUNK = 107.0


def stream_chunks(suites: dict[str, Any]) -> Verdict:
    """Issue 17: at 1,000 streams, at least 2x the chunks per router core of one process."""
    s = suites.get("streams") or {}
    rows = [r for r in s.get("rows", []) if r["target"] == "narwhal"]
    name = (
        f"At 1,000 concurrent streams: ≥ 2x the chunks/s per router core of one process "
        f"before issue 17 ({BASE_US_PER_CHUNK:.0f} µs of CPU per chunk), no stalls"
    )
    if not rows or rows[0].get("cpu_us_per_chunk") is None:
        return Verdict(name, "-", None)
    r = rows[0]
    us = r["cpu_us_per_chunk"]
    gain = BASE_US_PER_CHUNK / us
    text = f"{us:.1f} µs/chunk over all the router's processes: {gain:.2f}x; {r['stalls']} stalls"
    met = gain >= 2 and r["stalls"] == 0 if s["streams"] >= 1000 else None
    return Verdict(name, text, met)


def faults(suites: dict[str, Any]) -> list[Verdict]:
    f = suites.get("faults") or {}
    rows = f.get("rows", [])
    out = []
    for policy in ("narwhal", "narwhal-bounded"):
        mine = [r for r in rows if r["router"] == policy]
        if not mine:
            continue
        fewer, hung, rotation = [], [], []
        for r in mine:
            peers = [
                p
                for p in rows
                if p["scenario"] == r["scenario"] and p["router"] in _peer_names(rows)
            ]
            best = min((p["failed"] for p in peers), default=None)
            # Fewer than a peer's zero is impossible: none failed counts as met.
            if best is not None and r["failed"] and r["failed"] >= best:
                mid = r.get("failed_midstream")
                after = f" ({mid} after the first byte)" if mid is not None else ""
                fewer.append(f"{r['scenario']} {r['failed']}{after} vs {best}")
            if r["hung"]:
                hung.append(f"{r['scenario']} {r['hung']}")
            out_s, budget = r["out_of_rotation_s"], r["budget_s"]
            if out_s is None:
                rotation.append(f"{r['scenario']} never")
            elif budget is not None and out_s > budget:
                rotation.append(f"{r['scenario']} {out_s:.2f} s > {budget:.2f} s")
        has_peers = any(p["router"] in _peer_names(rows) for p in rows)
        if policy == "narwhal-bounded":
            out.append(_no_lost_streams(mine))
        out += [
            Verdict(
                f"{policy}: fewer failed requests than every peer (or none), every scenario",
                "; ".join(fewer) or "yes",
                (not fewer) if has_peers else None,
            ),
            Verdict(f"{policy}: zero hung past deadline", "; ".join(hung) or "0", not hung),
            Verdict(
                f"{policy}: faulty engine out of rotation within budget",
                "; ".join(rotation) or "yes",
                not rotation,
            ),
        ]
    return out


# Where migration (issue 18) must save every stream: the decode dies, freezes or stalls.
MIGRATION_SCENARIOS = ("decode_killed", "frozen", "stall_mid_stream")


def _no_lost_streams(rows: list[dict[str, Any]]) -> Verdict:
    name = (
        "narwhal-bounded: no failed request where a decode dies, freezes or stalls mid-stream "
        f"({', '.join(MIGRATION_SCENARIOS)})"
    )
    cells = [r for r in rows if r["scenario"] in MIGRATION_SCENARIOS]
    if not cells:
        return Verdict(name, "-", None)
    text = "; ".join(
        f"{r['scenario']} {r['failed']} ({r.get('migrations', 0):.0f} migrated)" for r in cells
    )
    return Verdict(name, text, all(r["failed"] == 0 for r in cells))


def _peer_names(rows: list[dict[str, Any]]) -> set[str]:
    return {r["router"] for r in rows if not r["router"].startswith("narwhal")}


def router_bound(suites: dict[str, Any]) -> list[Verdict]:
    """Issue 17 §4, router-bound: Narwhal with `workers: auto` against vllm-router in every
    cell of the router_bound suite; no rows when the suite did not run."""
    suite = suites.get("router_bound") or {}
    name = rb.judged(suite) if suite else None
    if name is None:
        return []
    cells = rb.target_cells(suite)
    workers = suite["workers"][name]
    n = rb.processes(suite, name)
    who = f"Router-bound ({name}: `workers: {workers}`, {n} worker{'s' if n != 1 else ''})"
    rps_name = (
        f"{who}: req/s ≥ {rb.RPS_TARGET}x {rb.BASE}'s (interim {rb.RPS_INTERIM}x), every cell"
    )
    cpu_name = f"{who}: CPU per request ≤ {rb.CPU_TARGET}x {rb.BASE}'s, every cell"
    if not cells:
        return [Verdict(rps_name, "-", None), Verdict(cpu_name, "-", None)]

    def each(key: str) -> str:
        return "; ".join(f"{rb.MODES[t['stream']]} c={t['c']} {t[key]:.2f}x" for t in cells)

    rps = each("rps")
    if not all(t["rps_met"] for t in cells) and all(t["rps_interim"] for t in cells):
        rps += f"; the interim {rb.RPS_INTERIM}x is met"
    failed = sum(t["failed"] for t in cells)
    if failed:
        rps += f"; {failed} requests failed across these cells"
    return [
        Verdict(rps_name, rps, all(t["rps_met"] for t in cells)),
        Verdict(cpu_name, each("cpu"), all(t["cpu_met"] for t in cells)),
    ]


PREFIX_CPU_TARGET = 1.2  # issue 30


def prefix_cpu(suites: dict[str, Any]) -> list[Verdict]:
    """Issue 30: placing by prefix costs at most 1.2x the router CPU per request of placing by
    load, router-bound (the prefix edge twin against its plain target, every cell); no row
    when the twin did not run."""
    cells = [t for t in rb.edge_cells(suites.get("router_bound") or {}) if t["kind"] == "prefix"]
    if not cells:
        return []
    name = (
        f"Router-bound ({cells[0]['twin']} ÷ {cells[0]['plain']}): CPU per request placing by "
        f"prefix ≤ {PREFIX_CPU_TARGET}x least_loaded's, every cell"
    )
    text = "; ".join(f"{rb.MODES[t['stream']]} c={t['c']} {t['cpu_x']:.2f}x" for t in cells)
    return [Verdict(name, text, all(t["cpu_x"] <= PREFIX_CPU_TARGET for t in cells))]


def router_wrk(suites: dict[str, Any]) -> list[Verdict]:
    """Issue 32, under wrk: each Narwhal target's CPU per request against the cheaper peer's
    (at most 1x; interim 1.5x) and the raw floor's (at most 1.5x), every cell; no rows when
    the suite did not run."""
    suite = suites.get("router_wrk") or {}
    out = []
    for target in rw.narwhal_targets(suite):
        peers = rw.against(suite, target, rw.PEERS)
        if peers:
            text = "; ".join(
                f"{rw.MODES[t['stream']]} c={t['c']} {t['ratio']:.2f}x {t['vs']}" for t in peers
            )
            worst = max(t["ratio"] for t in peers)
            if worst > 1 and worst <= rw.INTERIM:
                text += f"; the interim {rw.INTERIM}x is met"
            name = f"Under wrk ({target}): CPU per request ≤ the cheaper peer's, every cell"
            out.append(Verdict(name, text, worst <= 1))
        floor = rw.against(suite, target, (rw.FLOOR,))
        if floor:
            text = "; ".join(f"{rw.MODES[t['stream']]} c={t['c']} {t['ratio']:.2f}x" for t in floor)
            name = f"Under wrk ({target}): CPU per request ≤ {rw.FLOOR_TARGET}x {rw.FLOOR}'s"
            out.append(Verdict(name, text, all(t["ratio"] <= rw.FLOOR_TARGET for t in floor)))
    return out


def verdicts(suites: dict[str, Any]) -> list[Verdict]:
    return [
        throughput(suites),
        added_latency(suites),
        streams(suites),
        stream_chunks(suites),
        *faults(suites),
        *router_bound(suites),
        *prefix_cpu(suites),
        *router_wrk(suites),
    ]


def render(suites: dict[str, Any]) -> str:
    return table(["target", "measured", ""], [v.row() for v in verdicts(suites)]) + "\n"
