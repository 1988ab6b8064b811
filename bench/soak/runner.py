"""One soak run: load, bad requests and the chaos schedule at once, then the invariants.

`narwhal`: the active/standby pair with every fault of the schedule. `peer`: one peer router
with the same schedule minus the router-only events (handoff directory, router kill, drains
and maintenance), reporting goodput only.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen.driver import LoadGen
from bench.loadgen.spec import RunResult, RunSpec
from bench.routers import Engines
from bench.sims import SimFleet
from bench.soak import invariants as inv
from bench.soak import translog
from bench.soak.badreq import BadAnswer, send_bad
from bench.soak.chaos import Chaos, remove_away
from bench.soak.pair import TIMINGS, Pair
from bench.soak.schedule import ROUTER_ONLY, Event, plan
from bench.soak.watch import Watch
from bench.tap_client import Tap

CLIENT_MARGIN_S = 2.0  # the client gives up this long after the router's request deadline
PLACEMENT_TOLERANCE_S = 0.25  # a leg placed just before the engine turned ineligible, in flight
WARM_S = 5.0  # a stint's fds and RSS are first read this long after it became the active
FD_TOLERANCE = 32  # sockets come and go with load: up to 2 per client plus pools' slack
RSS_TOLERANCE_KB = 24 * 1024
BAD_EVERY_S = 0.5


@dataclass(frozen=True, slots=True)
class Setup:
    loadgen: LoadGen
    fleet: SimFleet
    tap: Tap
    engines: Engines  # the tap's URLs
    work: Path
    model: str
    request_timeout_s: float
    concurrency: int = 8
    max_tokens: int = 16

    @property
    def roles(self) -> dict[str, str]:
        return {s.name: s.role for s in self.fleet.sims}


def schedule(seed: int, duration_s: float, roles: dict[str, str]) -> list[Event]:
    return plan(random.Random(seed), duration_s, roles, router_faults=True)


def _load(
    setup: Setup, name: str, url: str, duration_s: float, failover: tuple[str, ...]
) -> RunSpec:
    return RunSpec(
        name=name,
        target="router",
        url=url + "/v1/completions",
        failover=failover,
        concurrency=setup.concurrency,
        max_requests=int(duration_s * 400),
        duration_s=duration_s,
        deadline_s=setup.request_timeout_s + CLIENT_MARGIN_S,
        model=setup.model,
        stream="mixed",
        max_tokens=setup.max_tokens,
        records=True,
    )


def goodput(result: RunResult, bad: list[BadAnswer]) -> dict[str, Any]:
    return {
        "requests": result.ok + result.failures + result.hung,
        "ok": result.ok,
        "ok_per_s": result.throughput,
        "failed": result.failures,
        "failed_by": dict(sorted(result.failed.items(), key=lambda kv: -kv[1])),
        "hung": result.hung,
        "elapsed_s": result.elapsed_s,
        "bad_requests": len(bad),
        "bad_by_status": _by_status(bad),
    }


def _by_status(bad: list[BadAnswer]) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, _, status, _ in bad:
        key = "no answer" if status is None else "connection lost" if status == 0 else str(status)
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


async def _drive(
    setup: Setup, spec: RunSpec, chaos: Chaos, events: list[Event], url: Any, seed: int
) -> tuple[RunResult, list[BadAnswer]]:
    until = chaos.t0 + spec.duration_s
    load = asyncio.create_task(setup.loadgen.run(spec))
    bad = asyncio.create_task(
        send_bad(random.Random(seed + 1), setup.model, url, until, BAD_EVERY_S,
                 setup.request_timeout_s + CLIENT_MARGIN_S)
    )  # fmt: skip
    await chaos.run(events)
    return await load, await bad


async def run_narwhal(setup: Setup, duration_s: float, seed: int, policy: str) -> dict[str, Any]:
    logs = setup.work / "logs"
    pair = Pair.plan(setup.engines, setup.work / "state" / "soak", logs, policy,
                     setup.request_timeout_s)  # fmt: skip
    events = schedule(seed, duration_s, setup.roles)
    try:
        await pair.start_pair()
        await _await_standby(pair)
        await setup.tap.dump()
        offset = translog.wall_to_mono()
        urls = tuple(m.url for m in pair.members.values())
        async with Watch(pair) as watch:
            chaos = Chaos(setup.fleet, time.monotonic(), pair, watch)

            def active_url() -> str | None:
                name = watch.active()
                return pair.members[name].url if name else None

            spec = _load(setup, "soak-narwhal", urls[0], duration_s, urls)
            result, bad = await _drive(setup, spec, chaos, events, active_url, seed)
        tapped = await setup.tap.dump()
        arrivals, arrival_ids = tapped["marked"], tapped.get("marked_ids", {})
        pids = {name: pair.pid(name) for name in pair.members}
    finally:
        await pair.stop()
        remove_away(pair)
    by_member: dict[str, list[Path]] = {}
    for name, log in pair.logs:
        by_member.setdefault(name, []).append(log)
    timelines = {n: translog.transitions(paths, offset) for n, paths in by_member.items()}
    all_logs = [log for _, log in pair.logs]
    stage = translog.stage_errors(all_logs, offset, "handoff")
    # Who places legs: the router seen answering /ready 200, and from the moment the soak
    # killed the active, its heir (the dead one places nothing, even before the heir is ready).
    kills = [(k["t_mono"], k["heir"]) for k in chaos.takeovers]
    active = sorted(inv.active_changes(watch.ready) + kills)
    prefixes = {
        prefix: name for name, paths in by_member.items()
        for prefix in translog.request_prefixes(paths)
    }  # fmt: skip
    misplaced = inv.misplaced(
        arrivals, timelines, active, PLACEMENT_TOLERANCE_S, arrival_ids, prefixes
    )
    stints = _stints(watch, active)
    grew = inv.growth(stints, FD_TOLERANCE, RSS_TOLERANCE_KB)
    seen = [
        any(s - 0.1 <= t <= e + 2 * TIMINGS["controller"]["monitor_interval_s"] for t, _ in stage)
        for s, e in chaos.dir_faults
    ]
    counts = {
        "hung_past_deadline": inv.hung(result.records, setup.request_timeout_s + CLIENT_MARGIN_S),
        "client_error_5xx": inv.client_error_5xx(bad),
        "sent_to_ineligible": len(misplaced),
        "handoff_unparseable": inv.handoff_unparseable(watch.handoff),
        "two_ready_routers": inv.split_brain(watch.ready),
        "drains_lost": inv.drains_lost(chaos.drain_checks),
        "fd_or_memory_growth": len(grew),
    }
    return {
        "router": "narwhal",
        "policy": policy,
        "seed": seed,
        "duration_s": duration_s,
        "events": [e.to_json() for e in events],
        "actions": chaos.done,
        "invariants": counts,
        "goodput": goodput(result, bad),
        "evidence": {
            "misplaced": [vars_(m) for m in misplaced[:20]],
            "client_error_5xx": [
                (round(t - chaos.t0, 2), kind, status, message)
                for t, kind, status, message in bad
                if status is None or status >= 500
            ][:20],
            "grew": [vars_(s) for s in grew],
            "stints": [vars_(s) for s in stints],
            "takeovers": chaos.takeovers,
            "drain_checks": len(chaos.drain_checks),
            "handoff_dir_faults": len(chaos.dir_faults),
            "handoff_dir_faults_with_stage_error": sum(seen),
            "handoff_stage_errors": _classes(stage),
            "ready_polls": len(watch.ready),
            "handoff_polls": len(watch.handoff),
            "legs_at_engines": sum(len(v) for v in arrivals.values()),
            "legs_placer_known": sum(
                1 for ids in arrival_ids.values() for i in ids if inv.placer(i, prefixes)
            ),
            "transitions": sum(len(v) for v in timelines.values()),
            "pids_at_end": pids,
            "t0": chaos.t0,
        },
    }


async def run_peer(
    setup: Setup, url: str, name: str, duration_s: float, seed: int
) -> dict[str, Any]:
    events = [e for e in schedule(seed, duration_s, setup.roles) if e.kind not in ROUTER_ONLY]
    chaos = Chaos(setup.fleet, time.monotonic())
    spec = _load(setup, f"soak-{name}", url, duration_s, ())
    result, bad = await _drive(setup, spec, chaos, events, lambda: url, seed)
    return {
        "router": name,
        "seed": seed,
        "events": len(events),
        "actions_failed": sum(1 for a in chaos.done if a.get("failed")),
        "goodput": goodput(result, bad),
        "hung_past_deadline": inv.hung(result.records, setup.request_timeout_s + CLIENT_MARGIN_S),
        "client_error_5xx": inv.client_error_5xx(bad),
    }


async def _await_standby(pair: Pair) -> None:
    from bench import web

    deadline = time.monotonic() + 30
    url = pair.members["b"].url + "/admin/lease"
    while time.monotonic() < deadline:
        status, body = await web.call("GET", url, timeout_s=2.0)
        if status == 200 and body.get("role") == "standby" and body.get("followed_sequence"):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("router-b did not follow router-a as a standby within 30 s")


def _stints(watch: Watch, active: list[tuple[float, str]]) -> list[inv.Stint]:
    end_all = watch.ready[-1][0] if watch.ready else 0.0
    out = []
    for i, (start, name) in enumerate(active):
        end = active[i + 1][0] if i + 1 < len(active) else end_all
        samples = [p for p in watch.procs if p[1] == name and start + WARM_S <= p[0] <= end]
        if not samples:
            continue
        pid = samples[0][2]
        samples = [p for p in samples if p[2] == pid]
        first, last = samples[0], samples[-1]
        if last[0] - first[0] < WARM_S:
            continue
        out.append(inv.Stint(name, pid, (first[3], last[3]), (first[4], last[4]),
                             round(last[0] - first[0], 1)))  # fmt: skip
    return out


def _classes(stage: list[tuple[float, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, cls in stage:
        out[cls] = out.get(cls, 0) + 1
    return out


def vars_(obj: Any) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in obj.__slots__}
