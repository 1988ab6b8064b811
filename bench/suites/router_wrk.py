"""Router-bound, measured with wrk (issue 32): the routers' CPU per request where they are the
bottleneck, from a C load generator beside the Python one (router_bound).

One prefill and one decode `bench.mock_engine` (answers at once, cheap per request), Narwhal
with `serving.workers` 1 and `auto`, vllm-router, sglang-router and the `floor-raw` relay in
front of them; `wrk -t1 -c{c}` sends `max_tokens` 8 and a 32-word prompt, non-streaming then
streaming, for `router_wrk_s` seconds per run. `router_wrk_reps` rounds, each running every
target once in a rotated order after its own 1 s warm-up; medians over the rounds.

CPU is utime + stime from /proc before and after each measured run: every process of the
router's tree (per role, as router_bound reads them), the two mock engines (so that "the engines
work harder behind router X" shows), and wrk's own (from `wait4`). Per 1,000 requests is over
the requests wrk completed (any status); a run where most requests failed is flagged, never
averaged away silently.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import web, wrk
from bench.context import CLIENT_GRACE_S, REQUEST_TIMEOUT_S, Context
from bench.procs import Proc, free_port, spawn
from bench.routers import Engines, Running
from bench.stats import median
from bench.suites.common import start_routers
from bench.suites.router_bound import NARWHAL, TreeSample, role_order, sample, spent

MAX_TOKENS = 8
PROMPT_WORDS = 32
WARM_S = 1.0
ENGINE_ROLES = ("prefill", "decode")
METRICS = (
    "rps",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "router_cpu_ms_per_1k",
    "engines_cpu_ms_per_1k",
    "prefill_cpu_ms_per_1k",
    "decode_cpu_ms_per_1k",
    "wrk_cpu_ms_per_1k",
    "processes",
)
BROKEN_SHARE = 0.5  # a run where more than this share of requests failed is flagged


@dataclass(slots=True)
class MockEngine:
    role: str
    port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_mock(ctx: Context, role: str) -> MockEngine:
    """One `bench.mock_engine` process serving `ctx.model`; a port taken in the meantime is
    retried on another."""
    for attempt in range(3):
        port = free_port()
        argv = [sys.executable, "-m", "bench.mock_engine", "--port", str(port)]
        argv += ["--model", ctx.model]
        proc, _ = await spawn(f"mock-{role}", argv, ctx.logs)
        try:
            await web.wait_until(f"http://127.0.0.1:{port}/health", alive=lambda p=proc: p.alive)
        except RuntimeError:
            await proc.stop()
            if attempt == 2:
                raise
            continue
        ctx.commands.setdefault(f"mock-{role}", " ".join(argv))
        return MockEngine(role, port, proc)
    raise AssertionError("unreachable")


def per_1k(cpu_s: float, requests: int) -> float:
    """CPU-ms per 1,000 requests: CPU seconds x 1e6 / requests (NaN without requests)."""
    return cpu_s * 1e6 / requests if requests else math.nan


def broken(requests: int, failed: int) -> bool:
    """Most requests failed, or none completed."""
    return requests == 0 or failed > BROKEN_SHARE * requests


def row(
    target: str,
    stream: str,
    c: int,
    rep: int,
    run: wrk.WrkRun,
    router: tuple[float, dict[str, dict[str, Any]]],
    engines: dict[str, float],
    asked: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """One measured run as the results file keeps it (pure: from what was read). `asked`:
    each engine's requests in the run by `/mock/stats` key (what the router asked of it)."""
    r = run.result
    n = r.requests
    router_cpu, roles = router
    for p in roles.values():
        p["cpu_ms_per_1k"] = per_1k(p["cpu_s"], n)
    engines_cpu = sum(engines.values())
    failed = r.failed
    return {
        "target": target,
        "stream": stream,
        "c": c,
        "rep": rep,
        "requests": n,
        "duration_s": r.duration_s,
        "rps": r.rps,
        "p50_ms": r.p50_ms,
        "p90_ms": r.p90_ms,
        "p99_ms": r.p99_ms,
        "non_2xx": r.non_2xx,
        "socket_errors": {
            "connect": r.connect_errors,
            "read": r.read_errors,
            "write": r.write_errors,
            "timeout": r.timeouts,
        },
        "failed": failed,
        "broken": broken(n, failed),
        "router_cpu_s": router_cpu,
        "router_cpu_ms_per_1k": per_1k(router_cpu, n),
        "procs": roles,
        "processes": sum(1 for p in roles.values() if p["pid"] is not None),
        "engines_cpu_s": engines_cpu,
        "engines_cpu_ms_per_1k": per_1k(engines_cpu, n),
        **{f"{role}_cpu_ms_per_1k": per_1k(engines.get(role, 0.0), n) for role in ENGINE_ROLES},
        "wrk_cpu_s": run.cpu_s,
        "wrk_cpu_ms_per_1k": per_1k(run.cpu_s, n),
        "engine_requests": asked or {},
    }


def asked_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What an engine answered between two `/mock/stats` reads (kinds with none left out)."""
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0)}


async def _stats(mocks: list[MockEngine]) -> dict[str, dict[str, int]]:
    out = {}
    for m in mocks:
        status, doc = await web.call("GET", m.url + "/mock/stats")
        out[m.role] = doc if status == 200 and isinstance(doc, dict) else {}
    return out


def failed_row(target: str, stream: str, c: int, rep: int, error: str) -> dict[str, Any]:
    """A run wrk could not make (it exited non-zero: e.g. no connection was accepted): kept,
    broken, with no numbers."""
    nan = math.nan
    return {
        "target": target,
        "stream": stream,
        "c": c,
        "rep": rep,
        "requests": 0,
        "duration_s": nan,
        "rps": 0.0,
        "p50_ms": nan,
        "p90_ms": nan,
        "p99_ms": nan,
        "non_2xx": 0,
        "socket_errors": {},
        "failed": 0,
        "broken": True,
        "error": error,
        "router_cpu_s": nan,
        "router_cpu_ms_per_1k": nan,
        "procs": {},
        "processes": nan,
        "engines_cpu_s": nan,
        "engines_cpu_ms_per_1k": nan,
        **{f"{role}_cpu_ms_per_1k": nan for role in ENGINE_ROLES},
        "wrk_cpu_s": nan,
        "wrk_cpu_ms_per_1k": nan,
        "engine_requests": {},
    }


def _engine_cpu(samples: dict[str, TreeSample], after: dict[str, TreeSample]) -> dict[str, float]:
    return {role: spent(samples[role], after[role])[0] for role in samples}


async def _measure(
    ctx: Context,
    router: Running,
    mocks: list[MockEngine],
    scripts: dict[str, Path],
    stream: str,
    c: int,
    rep: int,
) -> dict[str, Any]:
    name = router.spec.name
    url = router.url + "/v1/completions"
    timeout_s = REQUEST_TIMEOUT_S + CLIENT_GRACE_S
    base = ctx.logs / f"wrk-{name}-c{c}-{stream}-r{rep}"
    assert router.proc is not None
    root = router.proc.pid
    try:
        await wrk.run(url, scripts[stream], c, WARM_S, timeout_s, base.with_suffix(".warm.txt"))
        stats0 = await _stats(mocks)
        engines0 = {m.role: sample(m.proc.pid) for m in mocks}
        before = sample(root)
        seconds = ctx.mode.router_wrk_s
        run = await wrk.run(url, scripts[stream], c, seconds, timeout_s, base.with_suffix(".txt"))
        after = sample(root)
    except RuntimeError as exc:
        return failed_row(name, stream, c, rep, str(exc))
    engines1 = {m.role: sample(m.proc.pid) for m in mocks}
    stats1 = await _stats(mocks)
    asked = {role: asked_delta(stats0[role], stats1[role]) for role in stats1}
    cpu = _engine_cpu(engines0, engines1)
    return row(name, stream, c, rep, run, spent(before, after), cpu, asked)


def _log(ctx: Context, r: dict[str, Any]) -> None:
    if "error" in r:
        ctx.log(f"router_wrk {r['target']:14} c={r['c']:<3} stream={r['stream']:3} {r['error']}")
        return
    procs = ", ".join(f"{role} {p['cpu_ms_per_1k']:.0f}" for role, p in sorted(r["procs"].items()))
    errors = {k: v for k, v in r["socket_errors"].items() if v}
    bad = f" non-2xx {r['non_2xx']}" if r["non_2xx"] else ""
    bad += f" socket errors {errors}" if errors else ""
    bad += " BROKEN" if r["broken"] else ""
    ctx.log(
        f"router_wrk {r['target']:14} c={r['c']:<3} stream={r['stream']:3} rep={r['rep']} "
        f"{r['rps']:7.0f} req/s p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms "
        f"router {r['router_cpu_ms_per_1k']:.0f} CPU-ms/1k ({procs}) "
        f"engines {r['engines_cpu_ms_per_1k']:.0f} wrk {r['wrk_cpu_ms_per_1k']:.0f}{bad}"
    )


def scripts(ctx: Context) -> dict[str, Path]:
    out = {}
    for stream in ("no", "yes"):
        path = ctx.work / f"wrk-post-{stream}.lua"
        doc = wrk.body(ctx.model, PROMPT_WORDS, MAX_TOKENS, stream == "yes")
        path.write_text(wrk.script(doc))
        out[stream] = path
    return out


async def _wrk_version() -> str:
    """wrk's banner line (`wrk -v` prints it and exits 1)."""
    proc = await asyncio.create_subprocess_exec(
        wrk.WRK, "-v", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return out.decode(errors="replace").splitlines()[0] if out else ""


def _targets(ctx: Context) -> list[str]:
    """The mode's targets the bench venv can run (`floor-raw` borrows uvloop and httptools),
    each Narwhal target followed by its `@base` twin under `--ab-src`."""
    out = []
    for name in ctx.mode.router_wrk_targets:
        missing = [m for m in ("uvloop", "httptools") if not ctx.venv.has(m)]
        if name == "floor-raw" and missing:
            ctx.skipped[name] = f"bench venv lacks {', '.join(missing)}"
            ctx.log(f"router_wrk: {name} skipped: {ctx.skipped[name]}")
            continue
        out.append(name)
        if ctx.ab_src is not None and name.startswith("narwhal"):
            out.append(f"{name}@base")  # the same target from the other tree, same rounds
    return out


async def run(ctx: Context) -> dict[str, Any]:
    mode = ctx.mode
    why = await wrk.ensure_installed(ctx.logs / "wrk-install.log")
    if why is not None:
        ctx.skipped["wrk"] = why
        ctx.log(f"router_wrk: skipped: {why}")
        return {"skipped": why}
    paths = scripts(ctx)
    mocks: list[MockEngine] = []
    routers: dict[str, Running] = {}
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for role in ENGINE_ROLES:
            mocks.append(await start_mock(ctx, role))
        engines = Engines(ctx.model, [mocks[0].url], [mocks[1].url])
        routers = await start_routers(ctx, _targets(ctx), engines, NARWHAL)
        order0 = list(routers)
        for stream in ("no", "yes"):
            for c in mode.router_wrk_c:
                for rep in range(mode.router_wrk_reps):
                    k = rep % len(order0) if order0 else 0
                    for name in order0[k:] + order0[:k]:
                        r = await _measure(ctx, routers[name], mocks, paths, stream, c, rep)
                        samples.append(r)
                        _log(ctx, r)
    finally:
        for router in routers.values():
            await router.stop()
        for m in mocks:
            await m.proc.stop()
    targets = list(routers)
    return {
        "targets": targets,
        "concurrency": list(mode.router_wrk_c),
        "max_tokens": MAX_TOKENS,
        "prompt_words": PROMPT_WORDS,
        "run_s": mode.router_wrk_s,
        "warm_s": WARM_S,
        "reps": mode.router_wrk_reps,
        "wrk": {
            "version": await _wrk_version(),
            "argv": wrk.argv(
                "<router>/v1/completions",
                Path("wrk-post-<stream>.lua"),
                mode.router_wrk_c[0],
                mode.router_wrk_s,
                REQUEST_TIMEOUT_S + CLIENT_GRACE_S,
            ),
            "script": paths["no"].read_text(),
        },
        "wall_s": time.monotonic() - t0,
        "medians": medians(samples, targets),
        "samples": samples,
    }


def per_request(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each engine's requests of each kind per client request, over all `rows` (summed, then
    divided): 1.0 prefill and 1.0 json when a router sends one leg to each."""
    total = sum(int(r["requests"]) for r in rows)
    sums: dict[str, dict[str, int]] = {}
    for r in rows:
        for role, kinds in r.get("engine_requests", {}).items():
            for kind, n in kinds.items():
                sums.setdefault(role, {})[kind] = sums.setdefault(role, {}).get(kind, 0) + n
    if not total:
        return {}
    return {role: {k: n / total for k, n in kinds.items()} for role, kinds in sums.items()}


def medians(samples: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    """One point per (stream, c, target): the median of each metric over the rounds, each
    router process's median CPU-ms per 1,000 requests, and over all rounds the requests, the
    failures by kind and how many runs were broken (most requests failed)."""
    out = []
    for stream, c in sorted({(s["stream"], s["c"]) for s in samples}):
        for target in targets:
            key = (target, stream, c)
            rows = [s for s in samples if (s["target"], s["stream"], s["c"]) == key]
            if not rows:
                continue
            point: dict[str, Any] = {m: median(float(r[m]) for r in rows) for m in METRICS}
            roles = sorted({role for r in rows for role in r["procs"]}, key=role_order)
            point["procs"] = {
                role: median(
                    float(r["procs"][role]["cpu_ms_per_1k"]) for r in rows if role in r["procs"]
                )
                for role in roles
            }
            errors: dict[str, int] = {}
            for r in rows:
                for kind, n in r["socket_errors"].items():
                    errors[kind] = errors.get(kind, 0) + int(n)
            point["socket_errors"] = {k: v for k, v in errors.items() if v}
            point["non_2xx"] = sum(int(r["non_2xx"]) for r in rows)
            point["failed"] = sum(int(r["failed"]) for r in rows)
            point["requests"] = sum(int(r["requests"]) for r in rows)
            point["broken_runs"] = sum(1 for r in rows if r["broken"])
            point["engine_requests_per_req"] = per_request(rows)
            out.append({"target": target, "stream": stream, "c": c, "reps": len(rows), **point})
    return out
