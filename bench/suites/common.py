"""Pieces the suites share: starting a set of routers, measuring one load run on one target."""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.context import CLIENT_GRACE_S, REQUEST_TIMEOUT_S, Context, router_spec
from bench.loadgen.spec import RunResult, RunSpec
from bench.procs import reset_peak, tree, tree_usage
from bench.routers import Engines, RouterSpec, Running, start_router
from bench.sims import SimFlags, SimFleet
from bench.tap_client import Tap


@asynccontextmanager
async def tapped_fleet(
    model: str, flags: SimFlags, logs: Path
) -> AsyncIterator[tuple[SimFleet, Tap, Engines]]:
    """Two prefill and two decode sims, each behind the tap (which timestamps every leg per
    engine); the routers are given the tap's URLs. Everything is stopped on exit."""
    fleet = SimFleet.plan(2, 2, model, flags, logs)
    tap = Tap(logs / "tap.log")
    try:
        await fleet.start()
        for s in fleet.sims:
            tap.add(s.name, s.port)
        await tap.start()
        yield (
            fleet,
            tap,
            Engines(
                model,
                [tap.url(s.name) for s in fleet.role("prefill")],
                [tap.url(s.name) for s in fleet.role("decode")],
            ),
        )
    finally:
        await tap.stop()
        await fleet.stop()


def spec_for(name: str, ab_src: Path | None, model: str | None = None) -> RouterSpec:
    """`router_spec(name, model)`, and `<name>@base`: the same Narwhal run from the `--ab-src`
    tree."""
    base, _, variant = name.partition("@")
    spec = replace(router_spec(base, model), name=name)
    if not variant:
        return spec
    if variant != "base" or spec.kind != "narwhal" or ab_src is None:
        raise ValueError(f"{name}: only a Narwhal target has an @base twin, with --ab-src")
    return replace(spec, src=ab_src)


async def start_routers(
    ctx: Context, names: list[str], engines: Engines, tweak: dict[str, Any] | None = None
) -> dict[str, Running]:
    """Start every available router; one that fails to start is recorded in ctx.skipped."""
    running: dict[str, Running] = {}
    for name in names:
        spec = spec_for(name, ctx.ab_src, ctx.model)
        if spec.kind in ctx.skipped:
            continue
        if tweak and spec.kind == "narwhal":
            spec = replace(spec, narwhal=merged(tweak, spec.narwhal))
        t0 = time.monotonic()
        try:
            running[name] = await start_router(spec, engines, ctx.work, ctx.venv, REQUEST_TIMEOUT_S)
            if spec.kind != "direct":
                ctx.log(f"{name} ready in {time.monotonic() - t0:.1f} s")
                ctx.commands.setdefault(name, shlex.join(running[name].argv))
            if running[name].config is not None:
                ctx.configs.setdefault(name, running[name].config)
        except (RuntimeError, OSError) as exc:
            if spec.kind == "narwhal":
                raise
            ctx.skipped[spec.kind] = f"did not start: {exc}"
            ctx.log(f"{name}: {ctx.skipped[spec.kind]}")
    return running


def merged(tweak: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """A suite's Narwhal config sections (`tweak`) under a variant's own, section by section:
    the variant's keys win."""
    out = {section: dict(values) for section, values in tweak.items()}
    for section, values in own.items():
        out[section] = {**out.get(section, {}), **values}
    return out


def run_spec(name: str, router: Running, engines: Engines, model: str, **kw: Any) -> RunSpec:
    """A load run against `router`; a router that requires a client key (`RouterSpec.api_key`)
    is sent it on every request, and no other is."""
    direct = router.spec.kind == "direct"
    return RunSpec(
        name=name,
        target="direct" if direct else "router",
        url="" if direct else router.url + "/v1/completions",
        prefill=tuple(engines.prefill),
        decode=tuple(engines.decode),
        model=model,
        deadline_s=REQUEST_TIMEOUT_S + CLIENT_GRACE_S,
        api_key=router.spec.api_key or "",
        **kw,
    )


@dataclass(frozen=True, slots=True)
class Measured:
    """One load run plus what the router process spent on it."""

    result: RunResult
    router_cpu_s: float
    peak_kb: int
    rss_before_kb: int

    @property
    def cpu_s_per_1k(self) -> float:
        done = self.result.ok + self.result.failures
        return self.router_cpu_s / done * 1000 if done else math.nan

    def row(self) -> dict[str, Any]:
        r = self.result
        return {
            "ok": r.ok,
            "failed": r.failures,
            "failed_by": r.failed,
            "hung": r.hung,
            "elapsed_s": r.elapsed_s,
            "throughput": r.throughput,
            "latency_ms": r.latency_ms,
            "ttft_ms": r.ttft_ms,
            "router_cpu_s": self.router_cpu_s,
            "router_cpu_s_per_1k": self.cpu_s_per_1k,
            "peak_rss_kb": self.peak_kb,
            "rss_before_kb": self.rss_before_kb,
            "client_cpu_util": r.client_cpu_s / r.elapsed_s,
            "chunks": r.chunks,
            "steady_chunks_per_s": r.steady_chunks_per_s,
            "gap_ms": r.gap_ms,
            "stalls": r.stalls,
            "peak_in_flight": r.peak_in_flight,
        }


async def measure(ctx: Context, router: Running, spec: RunSpec) -> Measured:
    proc = router.proc
    if proc is None:
        return Measured(await ctx.loadgen.run(spec), math.nan, 0, 0)
    # Every process of the router: Narwhal's data-plane workers are children of the process
    # started (the peers are one process, so this is the same for them).
    for pid in tree(proc.pid):
        reset_peak(pid)
    cpu_before, rss_before, _ = tree_usage(proc.pid)
    result = await ctx.loadgen.run(spec)
    cpu_after, hwm_after, _ = tree_usage(proc.pid)
    return Measured(result, cpu_after - cpu_before, hwm_after, rss_before)
