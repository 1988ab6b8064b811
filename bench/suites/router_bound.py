"""Router-bound, with data-plane workers (issue 17 §4): Narwhal with `serving.workers` 1, 2 and
`auto` (or the `--workers-sweep` list) beside vllm-router and sglang-router, and the bounded
twin: Narwhal at some of those workers values (`auto` by default) again under
`serving.policy: bounded`, where a stream that may migrate is relayed event by event through
the migration splice instead of as raw bytes, for its cost beside `single_attempt`; and the
edge twins: Narwhal at `auto` again with client keys on (`narwhal-wauto-auth`: `auth.api_keys_env`
set, every request carrying `Authorization: Bearer <key>`), with the access log on
(`narwhal-wauto-access`: `logging.access: true`, one JSON line per request to the router's
stderr, which the bench captures to its log file), placing by prefix (`narwhal-wauto-prefix`:
`placement.policy: prefix` with the bench's tokenizer: every prompt tokenized, keyed, matched
and its placement shared with the other workers) and with flow control on
(`narwhal-wauto-flow`: each request asks the control process for a start, which the engines'
room grants at once here), for the cost of each on the request path.

One prefill and one decode sim that answer at once (no inter-token latency, no TTFT delay),
`max_tokens` 8, c=64 and c=256, non-streaming then streaming; `reps` rounds, each running every
target once in a rotated order after its own warm-up run, medians over the rounds. What the
issue asks of it: does Narwhal with one worker per core carry at least vllm-router's req/s, at
no more than 1.5x its CPU per request.

Router CPU is utime + stime of every process of the router (the one started and its
descendants: for Narwhal the control process and its worker children), read from /proc
before and after the measured run, per process and in total; RSS is each process's VmRSS at
the end of the run. For Narwhal, `narwhal_requests_total` by outcome is read from `/metrics`
around each run (outside the CPU window), so saturation 503s are told apart from errors, and
`/admin/workers` once at the end, for restarts.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench import web
from bench.context import Context
from bench.procs import reaped_cpu_s, tree, usage
from bench.routers import Engines, Running
from bench.sims import SimFlags, SimFleet
from bench.stats import median
from bench.suites.common import run_spec, start_routers

FLAGS = SimFlags(itl_ms=0.0, ttft_per_token_ms=0.0)
MAX_TOKENS = 8
PROMPT_WORDS = 32
PEERS = ("vllm-router", "sglang-router")
METRICS = (
    "throughput",
    "p50_ms",
    "p99_ms",
    "ttft_p50_ms",
    "router_cpu_s_per_1k",
    "cpu_us_per_chunk",
    "rss_kb",
    "processes",
    "client_cpu_util",
    "failed",
    "log_bytes_per_req",
)
_WORKER_MODULE = "narwhal.process.worker"
_ZYGOTE_MODULE = "narwhal.process.zygote"  # workers are forked from it: they share its argv


# Sized for the load, as an operator would: each of c=256 requests can hold a socket to its
# prefill and one to its decode engine at once. At the default (256) the c=256 cells would
# measure the bound (sockets closed and reopened on every leg), not the router.
MAX_CONNECTIONS = 1024
NARWHAL = {"serving": {"max_connections": MAX_CONNECTIONS}}


def narwhal_target(workers: str) -> str:
    """The bench's name for Narwhal with `serving.workers` = `workers` (bench.context)."""
    return f"narwhal-w{workers}"


def bounded_target(workers: str) -> str:
    """The same under `serving.policy: bounded`: the bounded twin of `narwhal_target`."""
    return f"narwhal-w{workers}-bounded"


# The edge twins (`--edge-twins`): what each turns on, beside plain Narwhal at this workers value
EDGE = {
    "auth": "client keys (`auth.api_keys_env`), `Authorization: Bearer <key>` on every request",
    "access": "the access log (`logging.access: true`), one JSON line per request",
    "prefix": "cache-aware placement (`placement.policy: prefix`, the bench's tokenizer)",
    "flow": "flow control (`flow.enabled: true`): every request asks the control process to start",
}
EDGE_WORKERS = "auto"


def edge_target(kind: str, workers: str = EDGE_WORKERS) -> str:
    """Narwhal with `kind` (`auth` or `access`) on: an edge twin of `narwhal_target`."""
    return f"narwhal-w{workers}-{kind}"


def edge_kind(target: str) -> str:
    """`auth` or `access` for an edge twin's name ("" for any other target)."""
    kind = target.rpartition("-")[2]
    return kind if target.startswith("narwhal-w") and kind in EDGE else ""


def plan(
    sweep: tuple[str, ...], twinned: tuple[str, ...], ab: bool, edge: tuple[str, ...] = ()
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The Narwhal targets, each with its `serving.workers` value, in the order they run (each
    bounded twin right after its `single_attempt` target, then the edge twins), bounded twin ->
    its `single_attempt` target, and edge twin -> its plain target. Only workers values in
    `sweep` get a bounded twin; the edge twins (`edge`: kinds of `EDGE`) run at `EDGE_WORKERS`
    when it is in `sweep`. `ab` (`--ab-src`): every target beside its `@base` twin from the
    other tree, but the edge twins, which run from this tree only (an older tree may not have
    the `auth` and `logging` sections) and are compared with this tree's plain target."""
    workers: dict[str, str] = {}
    twins: dict[str, str] = {}
    edges: dict[str, str] = {}
    for w in sweep:
        workers[narwhal_target(w)] = w
        if w in twinned:
            workers[bounded_target(w)] = w
            twins[bounded_target(w)] = narwhal_target(w)
        if w == EDGE_WORKERS:
            for kind in edge:
                workers[edge_target(kind, w)] = w
                edges[edge_target(kind, w)] = narwhal_target(w)
    if ab:
        workers = {
            n: w for t, w in workers.items() for n in ((t,) if t in edges else (t, f"{t}@base"))
        }
        twins = {n: m for t, s in twins.items() for n, m in ((t, s), (f"{t}@base", f"{s}@base"))}
    return workers, twins, edges


def parse_twin(text: str) -> tuple[str, ...]:
    """`--bounded-twin`: workers values as for `parse_workers`, or `none` for no twin."""
    return () if text.strip() == "none" else parse_workers(text)


def parse_edge(text: str) -> tuple[str, ...]:
    """`--edge-twins`: any of `auth`, `access`, `prefix` and `flow` (`auth,prefix`), or
    `none`; ValueError otherwise."""
    if text.strip() == "none":
        return ()
    out: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if item not in EDGE:
            raise ValueError(f"not an edge twin: {item!r} ({', '.join(EDGE)} or none)")
        if item not in out:
            out.append(item)
    return tuple(out)


def parse_workers(text: str) -> tuple[str, ...]:
    """`1,2,4,8` or `1,2,auto`: each a positive integer or `auto`; ValueError otherwise."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if item != "auto" and not (item.isdigit() and int(item) >= 1):
            raise ValueError(f"not a worker count: {item!r} (a positive integer or auto)")
        if item not in out:
            out.append(item)
    if not out:
        raise ValueError("no worker counts given")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One process of a router at one moment."""

    pid: int
    role: str  # control, worker K, zygote, router, or child N
    cpu_s: float
    rss_kb: int


@dataclass(frozen=True, slots=True)
class TreeSample:
    """Every live process of a router, and what its exited children spent (reaped)."""

    procs: dict[int, ProcSample]
    reaped_s: float


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")


def _worker_index(argv: list[str]) -> int | None:
    """K for a `python -m narwhal.process.worker ... --index K` command line, else None."""
    if _WORKER_MODULE not in argv or "--index" not in argv:
        return None
    try:
        return int(argv[argv.index("--index") + 1])
    except (IndexError, ValueError):
        return None


def sample(root: int) -> TreeSample:
    """CPU and RSS of `root` and each of its descendants, each named by its role: Narwhal's
    data-plane workers by their index (an older revision's, exec'd with `--index K`) or in pid
    order (forked by the `zygote`, whose command line they keep), the process started by the
    bench `control` when it has workers and `router` otherwise, anything else `child N` (in
    pid order)."""
    found: dict[int, tuple[str, float, int]] = {}
    children = 0
    workers = 0
    zygote_seen = False
    for pid in tree(root):
        try:
            u = usage(pid)
        except (OSError, ValueError, IndexError):
            continue  # gone in the meantime
        argv = _cmdline(pid) if pid != root else []
        index = _worker_index(argv)
        if pid == root:
            role = "router"
        elif index is not None:
            role, workers = f"worker {index}", workers + 1
        elif _ZYGOTE_MODULE in argv and not zygote_seen:
            role, zygote_seen = "zygote", True  # first in the tree's order, its children after
        elif _ZYGOTE_MODULE in argv:
            role, workers = f"worker {workers}", workers + 1
        else:
            role, children = f"child {children}", children + 1
        found[pid] = (role, u.cpu_s, u.rss_kb)
    if workers and root in found:
        found[root] = ("control", *found[root][1:])
    try:
        reaped = reaped_cpu_s(root)
    except (OSError, ValueError, IndexError):
        reaped = 0.0
    procs = {pid: ProcSample(pid, role, cpu, rss) for pid, (role, cpu, rss) in found.items()}
    return TreeSample(procs, reaped)


def spent(before: TreeSample, after: TreeSample) -> tuple[float, dict[str, dict[str, Any]]]:
    """Total CPU seconds between two samples, and per role: CPU seconds, pid, RSS at the end,
    and whether the role's process changed (a restarted worker). A process that appeared in
    between counts all its CPU; one that exited and was reaped counts through `reaped_s`."""
    roles: dict[str, dict[str, Any]] = {}
    old = {p.role: p for p in before.procs.values()}
    for p in after.procs.values():
        cpu = p.cpu_s - before.procs[p.pid].cpu_s if p.pid in before.procs else p.cpu_s
        prior = old.get(p.role)
        roles[p.role] = {
            "pid": p.pid,
            "cpu_s": cpu,
            "rss_kb": p.rss_kb,
            "restarted": prior is not None and prior.pid != p.pid,
        }
    exited = after.reaped_s - before.reaped_s
    if exited > 0:
        roles["exited children"] = {"pid": None, "cpu_s": exited, "rss_kb": 0, "restarted": False}
    return sum(r["cpu_s"] for r in roles.values()), roles


async def outcomes(router: Running) -> dict[str, float]:
    """Narwhal's `narwhal_requests_total`, summed by outcome (every endpoint); {} for peers
    or when /metrics does not answer."""
    if router.spec.kind != "narwhal":
        return {}
    try:
        status, text = await web.call("GET", router.url + "/metrics")
    except (aiohttp.ClientError, TimeoutError):
        return {}
    if status != 200:
        return {}
    out: dict[str, float] = {}
    for line in str(text).splitlines():
        if not line.startswith("narwhal_requests_total{"):
            continue
        labels, _, value = line.rpartition(" ")
        outcome = labels.split('outcome="', 1)[-1].split('"', 1)[0]
        out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, int]:
    return {k: round(v - a.get(k, 0.0)) for k, v in sorted(b.items()) if v - a.get(k, 0.0) > 0}


async def _measure(
    ctx: Context, router: Running, engines: Engines, name: str, stream: str, c: int, rep: int
) -> dict[str, Any]:
    spec = run_spec(
        f"router_bound-{name}-c{c}-{stream}-r{rep}",
        router,
        engines,
        ctx.model,
        concurrency=c,
        max_requests=1_000_000,
        duration_s=ctx.mode.router_bound_s,
        stream=stream,
        max_tokens=MAX_TOKENS,
        prompt_words=PROMPT_WORDS,
    )
    warm = replace(spec, name=spec.name + "-warm", max_requests=4 * c, duration_s=10.0)
    await ctx.loadgen.run(warm)
    assert router.proc is not None
    root = router.proc.pid
    counts0 = await outcomes(router)
    log0 = _size(router.proc.log)
    before = sample(root)
    result = await ctx.loadgen.run(spec)
    after = sample(root)
    log_bytes = _size(router.proc.log) - log0
    counts1 = await outcomes(router)
    cpu, roles = spent(before, after)
    done = result.ok + result.failures
    per_1k = 1000 / done if done else math.nan
    for r in roles.values():
        r["cpu_s_per_1k"] = r["cpu_s"] * per_1k
    chunks = result.chunks if stream == "yes" else 0
    return {
        "target": name,
        "stream": stream,
        "c": c,
        "rep": rep,
        "ok": result.ok,
        "failed": result.failures,
        "failed_by": result.failed,
        "hung": result.hung,
        "elapsed_s": result.elapsed_s,
        "throughput": result.throughput,
        "p50_ms": result.latency_ms.get("p50", math.nan),
        "p99_ms": result.latency_ms.get("p99", math.nan),
        "ttft_p50_ms": result.ttft_ms.get("p50", math.nan) if stream == "yes" else math.nan,
        "chunks": chunks,
        "client_cpu_util": result.client_cpu_s / result.elapsed_s,
        "router_cpu_s": cpu,
        "router_cpu_s_per_1k": cpu * per_1k,
        "cpu_us_per_chunk": cpu * 1e6 / chunks if chunks else math.nan,
        "log_bytes": log_bytes,  # what the router wrote to its stderr (the access log, if on)
        "log_bytes_per_req": log_bytes / done if done else math.nan,
        "rss_kb": sum(r["rss_kb"] for r in roles.values()),
        "processes": sum(1 for r in roles.values() if r["pid"] is not None),
        "procs": roles,
        "outcomes": _delta(counts0, counts1),
    }


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


async def _refused_without_key(ctx: Context, router: Running) -> int | None:
    """The status of one completion sent to an auth twin without a key (401 when auth is on),
    outside any measurement; None when it did not answer."""
    body = {"model": ctx.model, "prompt": "w0", "max_tokens": 1}
    try:
        status, _ = await web.call("POST", router.url + "/v1/completions", body)
    except (aiohttp.ClientError, TimeoutError):
        return None
    return status


def _access_lines(path: Path) -> int:
    """The access log's lines in a router's log file (each a JSON object with an outcome)."""
    n = 0
    try:
        with path.open("rb") as f:
            for line in f:
                n += line.startswith(b"{") and b'"outcome"' in line
    except OSError:
        return 0
    return n


async def _workers_status(router: Running) -> list[dict[str, Any]]:
    """Narwhal's `/admin/workers` (no admin token is configured in the bench); [] otherwise."""
    if router.spec.kind != "narwhal":
        return []
    try:
        status, body = await web.call("GET", router.url + "/admin/workers")
    except (aiohttp.ClientError, TimeoutError):
        return []
    if status != 200:
        return []
    if isinstance(body, dict):
        body = body.get("workers", [])
    return list(body) if isinstance(body, list) else []


def _log(ctx: Context, row: dict[str, Any]) -> None:
    procs = ", ".join(f"{role} {p['cpu_s_per_1k']:.3f}" for role, p in sorted(row["procs"].items()))
    failed = f" failed {row['failed']} {row['failed_by']}" if row["failed"] else ""
    ctx.log(
        f"router_bound {row['target']:21} c={row['c']:<3} stream={row['stream']:3} "
        f"rep={row['rep']} {row['throughput']:7.0f} req/s p50 {row['p50_ms']:.2f} ms "
        f"cpu/1k {row['router_cpu_s_per_1k']:.3f} s ({procs}){failed}"
    )


async def run(ctx: Context) -> dict[str, Any]:
    mode = ctx.mode
    workers, twins, edges = plan(
        mode.router_bound_workers,
        mode.router_bound_bounded,
        ctx.ab_src is not None,
        mode.router_bound_edge,
    )
    missing = [w for w in mode.router_bound_bounded if w not in mode.router_bound_workers]
    if missing:
        ctx.log(f"router_bound: no bounded twin for workers {missing}: not in the sweep")
    if mode.router_bound_edge and EDGE_WORKERS not in mode.router_bound_workers:
        ctx.log(f"router_bound: no edge twins: workers {EDGE_WORKERS} is not in the sweep")
    names = [*workers, *PEERS]
    fleet = SimFleet.plan(1, 1, ctx.model, FLAGS, ctx.logs)
    await fleet.start()
    engines = Engines(
        ctx.model, [s.url for s in fleet.role("prefill")], [s.url for s in fleet.role("decode")]
    )
    samples: list[dict[str, Any]] = []
    status: dict[str, list[dict[str, Any]]] = {}
    checks: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    routers: dict[str, Running] = {}
    try:
        routers = await start_routers(ctx, names, engines, NARWHAL)
        for name in edges:
            if name in routers and edge_kind(name) == "auth":
                refused = await _refused_without_key(ctx, routers[name])
                checks[name] = {"status_without_key": refused}
                if refused != 401:
                    ctx.log(f"router_bound: {name} answered {refused} without a key, not 401")
        order0 = list(routers)
        for stream in ("no", "yes"):
            for c in mode.router_bound_c:
                for rep in range(mode.router_bound_reps):
                    order = order0[rep % len(order0) :] + order0[: rep % len(order0)]
                    for name in order:
                        if name in twins and stream not in mode.router_bound_bounded_streams:
                            continue
                        row = await _measure(ctx, routers[name], engines, name, stream, c, rep)
                        samples.append(row)
                        _log(ctx, row)
        for name in workers:
            if name in routers:
                status[name] = await _workers_status(routers[name])
        for name in edges:
            proc = routers[name].proc if name in routers else None
            if proc is not None and edge_kind(name) == "access":
                checks[name] = {
                    "log": proc.log.name,
                    "log_bytes": _size(proc.log),
                    "access_lines": _access_lines(proc.log),
                }
    finally:
        for r in routers.values():
            await r.stop()
        await fleet.stop()
        await ctx.loadgen.reset()
    targets = list(routers)
    return {
        "targets": targets,
        "workers": {n: w for n, w in workers.items() if n in routers},
        "bounded": {t: s for t, s in twins.items() if t in routers and s in routers},
        "bounded_streams": [
            s for s in ("no", "yes") if s in mode.router_bound_bounded_streams and twins
        ],
        "edge": {t: s for t, s in edges.items() if t in routers and s in routers},
        "edge_checks": checks,
        "worker_processes": _worker_processes(samples),
        "workers_status": status,
        "concurrency": list(mode.router_bound_c),
        "max_tokens": MAX_TOKENS,
        "prompt_words": PROMPT_WORDS,
        "max_connections": MAX_CONNECTIONS,
        "run_s": mode.router_bound_s,
        "reps": mode.router_bound_reps,
        "usable_cpus": len(os.sched_getaffinity(0)),  # what `workers: auto` resolves to
        "wall_s": time.monotonic() - t0,
        "medians": medians(samples, targets),
        "samples": samples,
    }


def _worker_processes(samples: list[dict[str, Any]]) -> dict[str, int]:
    """How many data-plane workers each Narwhal target ran (the most seen in any run)."""
    out: dict[str, int] = {}
    for s in samples:
        n = sum(1 for role in s["procs"] if role.startswith("worker "))
        out[s["target"]] = max(out.get(s["target"], 0), n)
    return out


def medians(samples: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    """One point per (stream, c, target): the median of each metric over the rounds, each
    process's median CPU per 1,000 requests and RSS, and the failures and Narwhal outcomes
    summed over the rounds."""
    out = []
    keys = sorted({(s["stream"], s["c"]) for s in samples})
    for stream, c in keys:
        for target in targets:
            rows = [
                s
                for s in samples
                if s["target"] == target and s["stream"] == stream and s["c"] == c
            ]
            if not rows:
                continue
            point: dict[str, Any] = {m: median(float(r[m]) for r in rows) for m in METRICS}
            roles = sorted({role for r in rows for role in r["procs"]}, key=role_order)
            point["procs"] = {
                role: {
                    key: median(float(r["procs"][role][key]) for r in rows if role in r["procs"])
                    for key in ("cpu_s_per_1k", "rss_kb")
                }
                for role in roles
            }
            point["restarted"] = sorted(
                {role for r in rows for role, p in r["procs"].items() if p["restarted"]}
            )
            point["failed_by"] = _sum_dicts(r["failed_by"] for r in rows)
            point["outcomes"] = _sum_dicts(r["outcomes"] for r in rows)
            point["requests"] = sum(r["ok"] + r["failed"] for r in rows)
            out.append({"target": target, "stream": stream, "c": c, "reps": len(rows), **point})
    return out


def role_order(role: str) -> tuple[int, int, str]:
    """control / router first, then workers by index, then anything else."""
    if role in ("control", "router"):
        return (0, 0, role)
    if role.startswith("worker "):
        return (1, int(role.split()[1]), role)
    return (2, 0, role)


def _sum_dicts(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in items:
        for k, v in d.items():
            out[k] = out.get(k, 0) + int(v)
    return out
