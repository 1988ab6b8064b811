"""The chaos soak, 60 seconds in CI: Narwhal's active/standby pair under mixed load while the
seeded schedule kills, freezes and faults engines, moves the handoff directory away, kills the
active router and drains engines. Every invariant count must be 0, and goodput non-trivial.
The long version with the peers is `make soak` (docs/soak.md)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from bench import procs
from bench.loadgen.driver import LoadGen
from bench.sims import SimFlags
from bench.soak.runner import Setup, run_narwhal, schedule
from bench.suites.common import tapped_fleet
from bench.tokenizer import write_tokenizer

pytestmark = pytest.mark.slow

# A seed whose 60 s schedule has every kind of fault, two router kills with a drain in force
# across each, and two handoff-directory faults (tests/e2e/test_soak.py pins what it covers).
SEED = 99
DURATION_S = 60.0


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    logs = tmp_path / "logs"
    logs.mkdir()
    model = str(write_tokenizer(tmp_path / "tokenizer"))
    loadgen = LoadGen(sys.executable, logs / "loadgen.log")
    try:
        async with tapped_fleet(model, SimFlags(itl_ms=5.0), logs) as (fleet, tap, engines):
            await loadgen.start()
            yield Setup(loadgen, fleet, tap, engines, tmp_path, model, request_timeout_s=10.0)
    finally:
        await loadgen.stop()
        await procs.stop_all()


def test_the_ci_seed_covers_every_fault() -> None:
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    events = schedule(SEED, DURATION_S, roles)
    kinds = {e.kind for e in events}
    assert {"router_kill", "handoff_dir", "drain", "maintenance", "engine_kill"} <= kinds
    assert {"engine_freeze", "burst_5xx", "stall_first_token", "no_done"} <= kinds
    assert all(e.end <= DURATION_S for e in events)


async def test_soak_keeps_every_invariant(setup: Setup) -> None:
    report = await run_narwhal(setup, DURATION_S, SEED, policy="bounded")
    evidence = report["evidence"]
    failed_actions = [a for a in report["actions"] if a.get("failed")]
    context = f"{report['invariants']}\n{evidence}\nfailed actions: {failed_actions}"
    assert report["invariants"] == dict.fromkeys(report["invariants"], 0), context
    assert not failed_actions, context
    # the faults really happened and were seen
    assert len(evidence["takeovers"]) == 2, context
    assert evidence["drain_checks"] >= 1, context
    assert evidence["handoff_dir_faults"] >= 1, context
    assert evidence["handoff_dir_faults_with_stage_error"] == evidence["handoff_dir_faults"]
    assert evidence["stints"], context
    # Legs are judged on the view of the router that placed them, named by their request ids.
    assert evidence["legs_placer_known"] >= 0.99 * evidence["legs_at_engines"], context
    good = report["goodput"]
    assert good["ok"] >= 500 and good["ok_per_s"] >= 10, good
    assert good["bad_requests"] >= 60, good
