"""`python -m bench --mode quick|full|soak --report FILE --results DIR [--suites a,b] [--no-peers]`.

`--workers-sweep 1,2,4,8` replaces the router_bound suite's Narwhal `serving.workers` values;
`--bounded-twin 1,auto` (or `none`) the ones it also runs under `serving.policy: bounded`;
`--edge-twins auth,access,prefix,flow` (or `none`) the edge twins of `workers: auto` it also
runs (client keys on, the access log on, placement by prefix, flow control on).

Starts everything on loopback, runs the suites in order (each bounded in requests and time),
stops everything, writes DIR/<mode>.json (raw results) and the Markdown report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import machine, procs, regression
from bench.context import PEER_KINDS, Context, jsonable, load_python, loadavg
from bench.loadgen.driver import LoadGen
from bench.modes import MODES
from bench.report.render import render
from bench.suites import (
    cache,
    control,
    faults,
    floor_ab,
    flow,
    llama,
    overhead,
    profile,
    router_bound,
    router_wrk,
    soak,
    streams,
)
from bench.tokenizer import write_tokenizer
from bench.venv import BenchVenv, ensure_venv

Suite = Callable[[Context], Awaitable[dict[str, Any]]]
SUITES: dict[str, Suite] = {
    "overhead": overhead.run,
    "streams": streams.run,
    "faults": faults.run,
    "control": control.run,
    "profile": profile.run,
    "llama": llama.run,
    "soak": soak.run,
    "floor_ab": floor_ab.run,
    "router_bound": router_bound.run,
    "cache": cache.run,
    "flow": flow.run,
    "router_wrk": router_wrk.run,
}


def _workers(text: str) -> tuple[str, ...]:
    try:
        return router_bound.parse_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _twin(text: str) -> tuple[str, ...]:
    try:
        return router_bound.parse_twin(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _edge(text: str) -> tuple[str, ...]:
    try:
        return router_bound.parse_edge(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=sorted(MODES), default="quick")
    p.add_argument("--report", required=True, help="the Markdown report to write")
    p.add_argument("--results", required=True, help="directory for raw JSON results and logs")
    p.add_argument("--suites", help="comma-separated subset (default: the mode's)")
    p.add_argument("--no-peers", action="store_true", help="skip installing and running peers")
    p.add_argument("--scenarios", help="fault scenarios to run (default: the mode's)")
    p.add_argument("--routers", help="routers for the fault suite (default: the mode's)")
    p.add_argument("--seed", type=int, help="the soak schedule's seed (default: the mode's)")
    p.add_argument("--soak-s", type=float, help="soak seconds per router (default: the mode's)")
    p.add_argument(
        "--flow-s", type=float, help="flow: seconds of overload per arm (default: the mode's)"
    )
    p.add_argument(
        "--workers-sweep",
        type=_workers,
        metavar="N,N,...",
        help="Narwhal serving.workers values for router_bound, e.g. 1,2,4,8 or 1,2,auto "
        "(default: the mode's, 1,2,auto)",
    )
    p.add_argument(
        "--bounded-twin",
        type=_twin,
        metavar="N,N,...|none",
        help="router_bound: the workers values (of the sweep) that also run under "
        "serving.policy: bounded, as narwhal-w<N>-bounded, or none (default: the mode's, auto)",
    )
    p.add_argument(
        "--edge-twins",
        type=_edge,
        metavar="auth,access,prefix,flow|none",
        help="router_bound: Narwhal at workers auto again with client keys on "
        "(narwhal-wauto-auth), the access log on (narwhal-wauto-access), placing by prefix "
        "(narwhal-wauto-prefix) and/or flow control on (narwhal-wauto-flow), or none "
        "(default: the mode's, all four)",
    )
    p.add_argument(
        "--reps",
        type=int,
        metavar="N",
        help="router_bound and router_wrk: rounds per cell, medians over them (default: the "
        "mode's, 3); an "
        "A/B of a few percent needs more than the default against this machine's noise",
    )
    p.add_argument(
        "--ab-src",
        type=Path,
        metavar="SRC",
        help="router_bound and router_wrk also run each Narwhal target from this source tree "
        "(another revision's src/, e.g. a git worktree) as <target>@base, side by side",
    )
    p.add_argument(
        "--wrk-targets",
        metavar="NAME,NAME,...",
        help="router_wrk: the targets to run (default: the mode's: narwhal-w1, narwhal-wauto, "
        "vllm-router, sglang-router, floor-raw); with --ab-src each Narwhal one also runs as "
        "<target>@base",
    )
    p.add_argument(
        "--profile-targets",
        metavar="NAME,NAME,...",
        help="profile: the Narwhal targets to profile (default: narwhal-w1,narwhal-wauto; "
        "e.g. narwhal-wauto-prefix)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="JSON",
        help="router_wrk: check Narwhal's CPU per request (as a ratio to floor-raw's in the "
        "same rounds) against this recorded run, failing with exit status 3 on a rise beyond "
        "the noise (default: bench/baselines/router_wrk.json)",
    )
    p.add_argument(
        "--record-baseline",
        action="store_true",
        help="router_wrk: record this run as the baseline instead of checking against it",
    )
    p.add_argument("--from-results", metavar="JSON", help="only re-render the report from JSON")
    return p


async def _main(args: argparse.Namespace) -> int:
    mode = MODES[args.mode]
    if args.scenarios:
        mode = replace(mode, fault_scenarios=tuple(args.scenarios.split(",")))
    if args.routers:
        mode = replace(mode, fault_routers=tuple(args.routers.split(",")))
    if args.seed is not None:
        mode = replace(mode, soak_seed=args.seed)
    if args.soak_s is not None:
        mode = replace(mode, soak_s=args.soak_s)
    if args.flow_s is not None:
        mode = replace(mode, flow_s=args.flow_s)
    if args.workers_sweep:
        mode = replace(mode, router_bound_workers=args.workers_sweep)
    if args.bounded_twin is not None:
        mode = replace(mode, router_bound_bounded=args.bounded_twin)
    if args.edge_twins is not None:
        mode = replace(mode, router_bound_edge=args.edge_twins)
    if args.profile_targets:
        mode = replace(mode, profile_targets=tuple(args.profile_targets.split(",")))
    if args.wrk_targets:
        mode = replace(mode, router_wrk_targets=tuple(args.wrk_targets.split(",")))
    if args.reps is not None:
        mode = replace(mode, router_bound_reps=args.reps, router_wrk_reps=args.reps)
    results_dir, work = _prepare(args.results, mode.name)
    started = time.time()
    if args.no_peers:
        venv = BenchVenv()
        skipped = dict.fromkeys(PEER_KINDS, "not run (--no-peers)")
    else:
        venv = await ensure_venv(work / "logs" / "bench-venv.log")
        skipped = {k: f"not installed: {venv.failed[k]}" for k in PEER_KINDS if k in venv.failed}
    model = str(write_tokenizer(work / "tokenizer"))
    loadgen = LoadGen(load_python(venv), work / "logs" / "loadgen.log")
    ab_src = args.ab_src.resolve() if args.ab_src else None
    if ab_src is not None and not (ab_src / "narwhal" / "__init__.py").is_file():
        print(f"--ab-src: {ab_src} holds no narwhal package", file=sys.stderr)
        return 2
    ctx = Context(mode, work, venv, loadgen, model, skipped=skipped, ab_src=ab_src)
    doc: dict[str, Any] = {
        "mode": mode.name,
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "command": " ".join(["python -m bench", *sys.argv[1:]]),
        "machine": machine.describe(venv),
        "loadavg_start": loadavg(),
        "load_python": load_python(venv),
        "suites": {},
        "errors": {},
    }
    failed = False
    await loadgen.start()
    try:
        names = args.suites.split(",") if args.suites else mode.suites
        for name in [s for s in names if s]:
            t0 = time.monotonic()
            ctx.log(f"suite {name}: start (load average {loadavg()})")
            try:
                doc["suites"][name] = await SUITES[name](ctx)
            except Exception:
                failed = True
                doc["errors"][name] = traceback.format_exc()
                ctx.log(f"suite {name} failed:\n{doc['errors'][name]}")
            finally:
                await procs.stop_all()
            ctx.log(f"suite {name}: {time.monotonic() - t0:.0f} s")
    finally:
        await loadgen.stop()
        await procs.stop_all()
    doc["skipped"] = ctx.skipped
    doc["notes"] = ctx.notes
    doc["commands"] = ctx.commands
    doc["narwhal_configs"] = ctx.configs
    doc["loadavg_end"] = loadavg()
    doc["duration_s"] = time.time() - started
    wrk_suite = doc["suites"].get("router_wrk")
    regressed = False
    if wrk_suite and not wrk_suite.get("skipped") and ab_src is None:
        if args.record_baseline:
            path = args.baseline or regression.BASELINE
            regression.record(wrk_suite, doc["command"], path)
            ctx.log(f"router_wrk: recorded as the baseline in {path}")
        else:
            found = regression.verdict(
                wrk_suite, regression.load(args.baseline or regression.BASELINE)
            )
            wrk_suite["regression"] = found
            regressed = found["ok"] is False
            for line in found.get("regressions", []):
                ctx.log(f"REGRESSION (CPU per request, router_wrk): {line}")
            if found["ok"] is None:
                ctx.log(f"router_wrk: not checked against a baseline: {found['why']}")
    raw, report = _write(doc, results_dir, Path(args.report))
    ctx.log(f"wrote {report} and {raw} in {doc['duration_s']:.0f} s")
    if regressed:
        ctx.log("FAILED: Narwhal's CPU per request rose beyond the noise (above)")
        return 3
    return 1 if failed else 0


def _prepare(results: str, mode: str) -> tuple[Path, Path]:
    results_dir = Path(results).resolve()
    work = results_dir / f"work-{mode}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    return results_dir, work


def _write(doc: dict[str, Any], results_dir: Path, report: Path) -> tuple[Path, Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    raw = results_dir / f"{doc['mode']}.json"
    raw.write_text(json.dumps(jsonable(doc), indent=1))
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(render(doc, raw))
    return raw, report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.from_results:
        raw = Path(args.from_results)
        Path(args.report).write_text(render(json.loads(raw.read_text()), raw))
        return 0
    return asyncio.run(_main(args))
