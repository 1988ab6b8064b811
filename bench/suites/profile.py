"""Where a request's CPU goes, per process and per step (issue 32 §1): py-spy sampling every
process of Narwhal under wrk, with each process's CPU counted from /proc.

The router_wrk suite's set-up (one prefill and one decode `bench.mock_engine` that answer at
once, `wrk -t1 -c64`, `max_tokens` 8): the router is the bottleneck, so its profile is the
request path's. Narwhal with `serving.workers: 1` (one process: the request path and the
control plane on one loop) and with its default `auto` (a control process and its workers),
non-streaming then streaming. While wrk runs, py-spy samples each process of the router
without pausing it (`--nonblocking`, collapsed stacks); idle samples (the loop waiting in
epoll) are left out, so shares are of each process's busy time. Each process's CPU over the
same run (utime + stime) divided by the requests wrk completed is its CPU per request; a
step's share of the process's busy samples times that is the step's microseconds per request.
A sample's step is the innermost Narwhal frame's module (`bench/profiles.py`, `STEPS`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from bench import wrk
from bench.context import CLIENT_GRACE_S, REQUEST_TIMEOUT_S, Context
from bench.profiles import steps
from bench.routers import Engines, Running
from bench.suites.common import start_routers
from bench.suites.router_bound import NARWHAL, role_order, sample, spent
from bench.suites.router_wrk import ENGINE_ROLES, MockEngine, per_1k, scripts, start_mock

RATE_HZ = 200
CONCURRENCY = 64
WARM_S = 1.0
ATTACH_S = 0.3  # py-spy's start before wrk's, so that the whole run is sampled


async def _record(ctx: Context, pid: int, seconds: float, out: Path) -> str | None:
    """Run py-spy on `pid` for `seconds`; returns an error text or None."""
    proc = await asyncio.create_subprocess_exec(
        str(ctx.venv.bin / "py-spy"),
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(seconds))),
        "--rate",
        str(RATE_HZ),
        "--format",
        "raw",
        "--function",
        "--nonblocking",
        "--output",
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    text, _ = await proc.communicate()
    if proc.returncode:
        return text.decode(errors="replace")[-500:]
    return None


def per_step(shares: list[tuple[str, float]], cpu_us_per_request: float) -> list[list[Any]]:
    """Each step's share of a process's busy samples and its microseconds per request (the
    share of the process's CPU per request)."""
    return [[name, share, share * cpu_us_per_request] for name, share in shares]


async def _profile(
    ctx: Context, router: Running, script: Path, stream: str, seconds: float
) -> dict[str, Any]:
    """One profiled wrk run of `router`: per process, CPU per request, steps and top
    functions."""
    assert router.proc is not None
    url = router.url + "/v1/completions"
    name = router.spec.name
    key = "stream" if stream == "yes" else "json"
    timeout_s = REQUEST_TIMEOUT_S + CLIENT_GRACE_S
    base = ctx.logs / f"profile-{name}-{key}"
    await wrk.run(url, script, CONCURRENCY, WARM_S, timeout_s, base.with_suffix(".warm.txt"))
    before = sample(router.proc.pid)
    profiled = {p.role: p.pid for p in before.procs.values() if p.role != "zygote"}
    outs = {
        role: ctx.work / f"profile-{name}-{key}-{role.replace(' ', '')}.txt" for role in profiled
    }
    records = {
        role: asyncio.create_task(_record(ctx, pid, seconds, outs[role]))
        for role, pid in profiled.items()
    }
    await asyncio.sleep(ATTACH_S)
    run = await wrk.run(url, script, CONCURRENCY, seconds, timeout_s, base.with_suffix(".txt"))
    after = sample(router.proc.pid)
    errors = {role: await task for role, task in records.items()}
    requests = run.result.requests
    _, roles = spent(before, after)
    processes: dict[str, Any] = {}
    for role in sorted(profiled, key=role_order):
        cpu_us = per_1k(roles.get(role, {}).get("cpu_s", 0.0), requests)
        if errors[role]:
            processes[role] = {"cpu_us_per_request": cpu_us, "error": errors[role]}
            continue
        s = steps(outs[role])
        processes[role] = {
            "cpu_us_per_request": cpu_us,
            "file": outs[role].name,
            "samples": s["samples"],
            "steps": per_step(s["steps"], cpu_us),
            "self": s["self"],
        }
    total_us = per_1k(sum(r["cpu_s"] for r in roles.values()), requests)
    ctx.log(
        f"profile {name} {key}: {run.result.rps:.0f} req/s, {total_us:.0f} CPU-µs/request, "
        + ", ".join(f"{r} {p['cpu_us_per_request']:.0f}" for r, p in processes.items())
    )
    return {
        "rps": run.result.rps,
        "requests": requests,
        "failed": run.result.failed,
        "cpu_us_per_request": total_us,
        "processes": processes,
    }


async def run(ctx: Context) -> dict[str, Any]:
    seconds = ctx.mode.profile_s
    if seconds <= 0:
        return {}
    if not ctx.venv.has("py-spy"):
        return {"error": f"py-spy not installed: {ctx.venv.failed.get('py-spy', 'skipped')}"}
    why = await wrk.ensure_installed(ctx.logs / "wrk-install.log")
    if why is not None:
        ctx.skipped["wrk"] = why
        return {"error": why}
    paths = scripts(ctx)
    mocks: list[MockEngine] = []
    routers: dict[str, Running] = {}
    profiles: dict[str, dict[str, Any]] = {}
    try:
        for role in ENGINE_ROLES:
            mocks.append(await start_mock(ctx, role))
        engines = Engines(ctx.model, [mocks[0].url], [mocks[1].url])
        routers = await start_routers(ctx, list(ctx.mode.profile_targets), engines, NARWHAL)
        for name, router in routers.items():
            for stream in ("no", "yes"):
                key = "stream" if stream == "yes" else "json"
                profile = await _profile(ctx, router, paths[stream], stream, seconds)
                profiles.setdefault(name, {})[key] = profile
    finally:
        for router in routers.values():
            await router.stop()
        for m in mocks:
            await m.proc.stop()
    return {
        "seconds": seconds,
        "rate_hz": RATE_HZ,
        "concurrency": CONCURRENCY,
        "load": "wrk -t1, bench.mock_engine prefill and decode",
        "targets": profiles,
    }
