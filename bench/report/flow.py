"""The `flow` suite's section: every arm side by side, then issue 31's targets judged on
Narwhal with flow control, against the same run.

Everything is computed here from the load generator's records (bench.loadgen.flow), each
`[sent_s, key, priority, status, latency_s, ttft_s, tokens, reason]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from bench.report.fmt import num, table
from bench.stats import percentile

K = TypeVar("K")
JUDGED = "narwhal-flow"
PREEMPTED = "narwhal-flow-preempt"  # judged too: the targets with `flow.preempt_priority`
BASELINE = "narwhal-flow-off"
SHED_MS = 50.0  # a refusal's answer, after the moment it was shed
FAIRNESS = 0.95
SLO_SHARE = 0.99
TOKENS_SHARE = 0.95


def jain(values: Iterable[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one
    has everything. None for no values or all zero."""
    xs = list(values)
    squares = sum(x * x for x in xs)
    if not xs or squares == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * squares)


def fair_shares(demands: Mapping[K, float], total: float) -> dict[K, float]:
    """Max-min fair shares of `total` (water filling): a client asking less than an equal
    split gets what it asks, the rest is split among the others the same way. Each share is
    min(demand, level)."""
    shares = dict.fromkeys(demands, 0.0)
    left = total
    open_ = sorted(demands, key=lambda k: demands[k])
    while open_ and left > 1e-12:
        level = left / len(open_)
        k = open_[0]
        if demands[k] <= level:
            shares[k] = demands[k]
            left -= demands[k]
            open_.pop(0)
            continue
        for k in open_:
            shares[k] = level
        break
    return shares


def fairness(served: Mapping[K, float], demand: Mapping[K, float]) -> float | None:
    """Jain's index of each client's service over its max-min fair share of what was served
    in all (min(its demand, the fair share)): a client that asked less than an equal split
    is not expected to get the split. Clients that asked nothing are left out."""
    asked = {k: d for k, d in demand.items() if d > 0}
    shares = fair_shares(asked, sum(served.get(k, 0.0) for k in asked))
    ratios = [served.get(k, 0.0) / s for k, s in shares.items() if s > 0]
    return jain(ratios)


def _pctl(values: Iterable[float], q: float) -> float | None:
    data = sorted(values)
    return percentile(data, q) if data else None


def _answer_tokens(fleet: Mapping[str, Any]) -> str:
    """What each request asked for: a fixed length, or a seeded uniform spread around it."""
    mean, spread = fleet["max_tokens"], fleet.get("max_tokens_spread", 0)
    if not spread:
        return str(mean)
    return f"{mean - spread}-{mean + spread} (uniform, mean {mean}, the same for every arm)"


def _served(r: list[Any]) -> bool:
    return bool(r[3] == 200 and not r[7])


def _began(r: list[Any], window: float) -> bool:
    """Its first token came within the overload's `window` (seconds from its start)."""
    return r[5] is not None and r[0] + r[5] <= window


def unloaded_ttft_ms(arm: Mapping[str, Any]) -> float | None:
    return _pctl((r[5] * 1000 for r in arm["unloaded"] if _served(r) and r[5] is not None), 50)


def analyze(
    arm: Mapping[str, Any], suite: Mapping[str, Any], slo_ms: float | None
) -> dict[str, Any]:
    """Everything the report says about one arm's loaded run."""
    records: list[list[Any]] = arm["records"]
    max_tokens = suite["fleet"]["max_tokens"]
    out: dict[str, Any] = {"arm": arm["arm"], "sent": len(records)}
    out["served"] = sum(1 for r in records if _served(r))
    out["refused"] = sum(1 for r in records if r[3] == 429)
    out["refused_by"] = _count(r[7] for r in records if r[3] == 429)
    out["server_errors"] = sum(1 for r in records if r[3] >= 500)
    out["server_by"] = _count(str(r[3]) for r in records if r[3] >= 500)
    out["hung"] = sum(1 for r in records if r[3] == -1)
    out["transport"] = sum(1 for r in records if r[3] == 0)
    out["other"] = out["sent"] - out["served"] - out["refused"] - out["server_errors"]
    out["other"] -= out["hung"] + out["transport"]
    out["other_by"] = _count(
        f"{r[3]} {r[7]}".strip()
        for r in records
        if not _served(r) and r[3] not in (429, -1, 0) and r[3] < 500
    )
    window = suite["flow_s"]
    in_window = [r for r in records if _served(r) and r[0] + r[4] <= window]
    tokens = sum(r[6] for r in in_window)
    out["output_tokens_per_s"] = tokens / window if window else None
    out["unloaded_ttft_ms"] = unloaded_ttft_ms(arm)
    priorities = sorted({r[2] for r in records})
    out["priorities"] = {}
    for p in priorities:
        mine = [r for r in records if r[2] == p]
        ttfts = [r[5] * 1000 for r in mine if _served(r) and r[5] is not None]
        keys = sorted({r[1] for r in mine})
        demand = {k: float(max_tokens * sum(1 for r in mine if r[1] == k)) for k in keys}
        # the service begun while overloaded (first token within the window): once the
        # arrivals stop, the queue drains what is left, mostly the heaviest key's, and that
        # tail says nothing of how the queue shared out the overload
        served = {
            k: float(sum(r[6] for r in mine if r[1] == k and _served(r) and _began(r, window)))
            for k in keys
        }
        shares = fair_shares(demand, sum(served.values()))
        within = None
        if slo_ms is not None and mine:
            within = sum(1 for t in ttfts if t <= slo_ms) / len(mine)
        out["priorities"][p] = {
            "sent": len(mine),
            "served": sum(1 for r in mine if _served(r)),
            "ttft_p50_ms": _pctl(ttfts, 50),
            "ttft_p99_ms": _pctl(ttfts, 99),
            "within_slo": within,
            "jain": fairness(served, demand),
            "demand": demand,
            "served_tokens": served,
            "fair_share": shares,
        }
    out["shed_ms"] = shed_latency_ms(records, suite["max_wait_s"])
    return out


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def shed_latency_ms(records: Iterable[list[Any]], max_wait_s: float) -> list[float]:
    """For each 429, the time from the moment it was shed to its answer, as the client can
    bound it: a refusal for its deadline was shed `max_wait_s` after it was sent (the time
    to reach the router counts against it); any other at once when it arrived (a waiting
    request pushed out of a full queue later counts its wait too)."""
    out = []
    for r in records:
        if r[3] != 429:
            continue
        late = r[4] - max_wait_s if r[7] == "deadline" else r[4]
        out.append(max(0.0, late) * 1000)
    return out


def slo_ms(suite: Mapping[str, Any]) -> float | None:
    """Priority 0's TTFT SLO: `slo_factor` times the judged arm's unloaded TTFT p50."""
    arm = next((a for a in suite["arms"] if a["arm"] == JUDGED), None)
    base = unloaded_ttft_ms(arm) if arm else None
    return None if base is None else base * suite["slo_factor"]


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def verdicts(
    rows: Mapping[str, dict[str, Any]], slo: float | None, arm: str = JUDGED
) -> list[list[str]]:
    """Issue 31's targets on `arm`: [target, measured, met / missed]."""
    mine = rows.get(arm)
    if mine is None:
        return [["all", "-", "not measured"]]
    out = []
    p0 = mine["priorities"].get(0)
    within = p0["within_slo"] if p0 else None
    what = f"priority 0: TTFT within {num(slo, 0)} ms (4x unloaded) for ≥ 99% of its requests"
    if within is None:
        out.append([what, "-", "not measured"])
    else:
        measured = f"{within:.1%} of {p0['sent']} (p99 {num(p0['ttft_p99_ms'], 0)} ms)"
        out.append([what, measured, _met(within >= SLO_SHARE)])
    for p, prio in sorted(mine["priorities"].items()):
        index = prio["jain"]
        what = f"priority {p}: Jain's index of served tokens ≥ {FAIRNESS} (vs min(demand, share))"
        if index is None:
            out.append([what, "-", "not measured (nothing served)"])
        else:
            out.append([what, f"{index:.3f}", _met(index >= FAIRNESS)])
    bad = mine["server_errors"] + mine["hung"] + mine["transport"] + mine["other"]
    measured = (
        f"{mine['served']} served, {mine['refused']} refused 429, {mine['server_errors']} 5xx, "
        f"{mine['transport']} connection errors, {mine['hung']} hung, {mine['other']} other"
    )
    out.append(
        ["every request served or refused 429: none 5xx, lost or hung", measured, _met(bad == 0)]
    )
    shed = mine["shed_ms"]
    what = f"429 within {SHED_MS:.0f} ms of being shed (p99; max shown)"
    if not shed:
        out.append([what, "no 429", "not measured"])
    else:
        p99 = _pctl(shed, 99) or 0.0
        out.append([what, f"p99 {p99:.1f} ms, max {max(shed):.1f} ms", _met(p99 <= SHED_MS)])
    base = rows.get(BASELINE)
    what = f"output tokens/s ≥ {TOKENS_SHARE:.0%} of flow control off"
    a = mine["output_tokens_per_s"]
    b = base["output_tokens_per_s"] if base else None
    if not a or not b:
        out.append([what, "-", "not measured"])
    else:
        out.append([what, f"{a:.0f} vs {b:.0f} ({a / b:.0%})", _met(a >= TOKENS_SHARE * b)])
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _arms_table(rows: list[dict[str, Any]]) -> str:
    priorities = sorted({p for r in rows for p in r["priorities"]})
    header = ["arm", "unloaded TTFT p50 ms", "sent", "served", "429", "5xx", "lost / hung"]
    header += ["output tok/s", "p0 within SLO"]
    header += [f"p{p} TTFT p50 / p99 ms" for p in priorities]
    header += [f"p{p} Jain" for p in priorities]
    header += ["429 after shed p99 / max ms"]
    body = []
    for r in rows:
        prios = r["priorities"]
        shed = r["shed_ms"]
        row = [
            r["arm"],
            num(r["unloaded_ttft_ms"], 0),
            r["sent"],
            r["served"],
            r["refused"],
            r["server_errors"],
            f"{r['transport'] + r['other']} / {r['hung']}",
            num(r["output_tokens_per_s"], 0),
            _pct(prios[0]["within_slo"]) if 0 in prios else "-",
        ]
        for p in priorities:
            q = prios.get(p, {})
            row.append(f"{num(q.get('ttft_p50_ms'), 0)} / {num(q.get('ttft_p99_ms'), 0)}")
        for p in priorities:
            index = prios.get(p, {}).get("jain")
            row.append("-" if index is None else f"{index:.3f}")
        row.append(f"{num(_pctl(shed, 99))} / {num(max(shed))}" if shed else "-")
        body.append(row)
    return table(header, body)


def _shares_table(r: dict[str, Any], heavy: int) -> str:
    keys = sorted({k for q in r["priorities"].values() for k in q["demand"]})
    names = [f"key {k}" + (" (10x)" if k == heavy else "") for k in keys]
    body = []
    for p, q in sorted(r["priorities"].items()):
        cells = [
            f"{q['served_tokens'].get(k, 0):.0f} / {q['fair_share'].get(k, 0):.0f} / "
            f"{q['demand'].get(k, 0):.0f}"
            for k in keys
        ]
        body.append([f"p{p}", *cells])
    return table(["priority", *names], body)


def _problems(r: dict[str, Any]) -> str:
    parts = []
    if r["refused_by"]:
        parts.append(
            "429 by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(r["refused_by"].items()))
        )
    if r["server_by"]:
        parts.append("5xx: " + ", ".join(f"{k} {v}" for k, v in sorted(r["server_by"].items())))
    if r["other_by"]:
        parts.append(
            "other answers: " + ", ".join(f"{k} {v}" for k, v in sorted(r["other_by"].items()))
        )
    return "; ".join(parts)


def render(suite: dict[str, Any]) -> str:
    slo = slo_ms(suite)
    rows = [analyze(a, suite, slo) for a in suite["arms"]]
    by_arm = {r["arm"]: r for r in rows}
    f = suite["fleet"]
    traffic = ", ".join(f"key {k} p{p} {s:.3g}" for k, p, s in suite["traffic"])
    out = [
        f"1 prefill and 1 decode `narwhal-sim` engine, each refusing beyond "
        f"`--max-concurrency` {f['max_concurrency']}, ITL {f['itl_ms']:.0f} ms, "
        f"{_answer_tokens(f)} tokens per answer (streamed), {f['prompt_words']}-word prompts: "
        f"a capacity of {f['capacity_rps']:.1f} requests/s. Each arm ran "
        f"{suite['unloaded_s']:.0f} s unloaded ({suite['unloaded_load']:.0%} of capacity, "
        "priority 0), then "
        f"{suite['flow_s']:.0f} s open-loop at {suite['overload']:.0f}x capacity, the same "
        "seeded Poisson arrivals for every arm, none retried. Offered load as a share of "
        f"capacity per key and priority: {traffic}. Priorities 0 and 1 are sent alike by every "
        "key, and the heavy key (0) sends 10x each of the others at priority 2: the counters that "
        "share out service are per key across priorities (DESIGN §13), so a key sent 10x at "
        "every priority would be behind the others at the lowest by design.",
        "",
        f"The TTFT SLO is {suite['slo_factor']:.0f}x `{JUDGED}`'s unloaded TTFT p50: "
        f"{num(slo, 0)} ms, for every arm; 'p0 within SLO' counts every priority-0 request "
        "sent, a refused one as a miss. Jain's index is over each key's served output tokens "
        "(the answers whose first token came during the overload: the drain after it is "
        "mostly the heaviest key's queue) divided by its max-min fair "
        "share of what that priority was served in all, "
        "min(its demand, the fair share): a key that asks less than an equal split cannot "
        "be expected to get the split, so it is judged against what it asked. Output tokens/s "
        f"counts the answers completed within the {suite['flow_s']:.0f} s. '429 after shed': a "
        f"refusal for its deadline was shed {suite['max_wait_s']:.0f} s (`flow.max_wait_s`) "
        "after it was sent, any other refusal when it arrived; the client's measure includes "
        "its trip to the router, so it bounds the delay from above.",
        "",
        f"Arms: `{JUDGED}` (`serving.policy: bounded`, `engines[].max_concurrency` "
        f"{f['max_concurrency']}, `flow.max_wait_s` {suite['max_wait_s']:.0f}, "
        f"`flow.queue_limit` {suite['queue_limit']}, four client keys in `auth` with "
        f"equal weights in `auth.key_policies`); `{JUDGED}-headroom` (the same with "
        f"`flow.headroom_slots` {suite.get('headroom_slots', 0)}: slots kept for priority 0); "
        f"`{PREEMPTED}` (the same with `flow.preempt_priority` "
        f"{suite.get('preempt_priority', 0)}: priority 0 takes a slot from a running stream of "
        "a less urgent priority, which goes on later from its last token); "
        f"`{BASELINE}` (the same under `single_attempt`: "
        "flow control off, today's behaviour); vllm-router and sglang-router with "
        f"`--max-concurrent-requests {f['max_concurrency']} --queue-size {suite['queue_limit']} "
        f"--queue-timeout-secs {suite['max_wait_s']:.0f}` (a FIFO queue, no priorities or "
        "per-key shares: they have none).",
        "",
        f"### Targets (`{JUDGED}`)",
        "",
        table(["target", "measured", ""], verdicts(by_arm, slo)),
        "",
    ]
    if PREEMPTED in by_arm:
        out += [
            f"### Targets (`{PREEMPTED}`: the same, with preemption)",
            "",
            table(["target", "measured", ""], verdicts(by_arm, slo, PREEMPTED)),
            "",
        ]
    out += [
        "### Side by side",
        "",
        _arms_table(rows),
        "",
    ]
    for r in rows:
        problems = _problems(r)
        out += [
            f"#### {r['arm']}: served / fair share / asked, output tokens",
            "",
            _shares_table(r, suite["heavy_key"]),
            "",
        ]
        if problems:
            out += [problems + ".", ""]
        arm = next(a for a in suite["arms"] if a["arm"] == r["arm"])
        if arm.get("narwhal_shed"):
            counts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(arm["narwhal_shed"].items()))
            out += [f"Narwhal's `narwhal_shed_total` at the end (both runs): {counts}.", ""]
    return "\n".join(out)
