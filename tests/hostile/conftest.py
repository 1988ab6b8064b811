"""The hostile suite's fixtures: one router per process mode for the whole session, with the
legitimate flow running through it, and a guard around every case.

The router runs `serving.workers: auto` (a control process and one worker per CPU) and `1`
(one process), whatever `NARWHAL_TEST_WORKERS` says: each case runs in both. Its limits are
set small so each case ends in seconds (`SERVING`). Two engine pairs sit behind it: the
legitimate flow's (`demo-model`) and the tap's (`tap-model`), which only hostile requests
name, so the tap sims' request logs hold exactly what the hostile clients got through.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.hostile.harness import Flow, FlowStats, RouterProcess, wait_sync
from tests.support.sim_process import SimFactory, SimProcess

MODES = ("workers", "single")
TOKEN = "hostile-admin-token"
KEYS = "sk-legit,sk-hostile"
MAX_BODY = 64 * 1024
MAX_CONNECTIONS = 1000
SERVING = {
    "client_header_timeout_s": 1.0,
    "client_body_timeout_s": 1.0,
    # above request_timeout_s: a stream never read is cut by its deadline first
    "client_send_timeout_s": 8.0,
    "max_body_bytes": MAX_BODY,
    "max_client_connections": MAX_CONNECTIONS,
    "request_timeout_s": 5,
    "first_token_timeout_s": 5,
    "stream_idle_timeout_s": 3,
}
# The legitimate flow's p99 under attack may be this many times its quiet p99, or FLOOR_S,
# whichever is larger: generous on purpose (2 shared cores in CI); the numbers are reported.
P99_FACTOR = 10.0
P99_FLOOR_S = 0.5
# The router's whole memory (control and workers) may not pass this.
RSS_LIMIT_BYTES = 1536 * 1024 * 1024
FILES = 16384  # descriptors: 2,000+ client sockets here, 1,000 in the router


@dataclass
class Result:
    case: str
    mode: str
    stats: FlowStats
    rss_bytes: int


RESULTS: list[Result] = []


@dataclass
class Tap:
    """The engines only hostile requests reach."""

    prefill: SimProcess
    decode: SimProcess

    def entries(self, marker: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The prefill and decode requests whose body mentions `marker`."""
        return (
            [e for e in self.prefill.requests() if marker in str(e["body"])],
            [e for e in self.decode.requests() if marker in str(e["body"])],
        )


@dataclass
class Hostile:
    """One router under attack, its flow, its tap, and its quiet numbers."""

    mode: str
    router: RouterProcess
    flow: Flow
    tap: Tap
    quiet: FlowStats
    quiet_rss_bytes: int
    peak_rss_bytes: int = 0
    cases: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def port(self) -> int:
        return self.router.port

    def p99_bound_s(self) -> float:
        return max(P99_FACTOR * self.quiet.p99_s, P99_FLOOR_S)


@pytest.fixture(scope="session")
def hostile_sims() -> Iterator[tuple[SimProcess, SimProcess, SimProcess, SimProcess]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FILES if hard == resource.RLIM_INFINITY else min(FILES, hard)
    if soft < wanted:  # the routers started below inherit it
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    factory = SimFactory()
    try:
        legit = ["--itl-ms", "0"]
        tap = ["--itl-ms", "0", "--model", "tap-model", "--max-model-len", "1000000"]
        p0, d0, p1, d1 = factory.start_many(
            [["--role", "prefill", "--kv-role", "kv_producer", *legit],
             ["--role", "decode", "--kv-role", "kv_consumer", *legit],
             ["--role", "prefill", "--kv-role", "kv_producer", *tap],
             ["--role", "decode", "--kv-role", "kv_consumer", *tap]]
        )  # fmt: skip
        yield p0, d0, p1, d1
    finally:
        factory.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _config(sims: tuple[SimProcess, ...], workdir: Path, workers: int | str) -> dict[str, Any]:
    p0, d0, p1, d1 = sims
    return {
        "router_id": f"hostile-{workers}",
        "listen": "127.0.0.1:0",
        "model": "demo-model",
        "engines": [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
            {"id": "p1", "url": p1.url, "role": "prefill", "model": "tap-model"},
            {"id": "d1", "url": d1.url, "role": "decode", "model": "tap-model"},
        ],
        "controller": {"monitor_interval_s": 0.5, "monitor_failure_limit": 3},
        "engine": {"health_timeout_s": 5.0, "probe_timeout_s": 5.0},
        "serving": {**SERVING, "workers": workers},
        "admin": {"token": TOKEN},
        "auth": {"api_keys_env": "HOSTILE_KEYS"},
        "handoff": {"path": str(workdir / "state" / "handoff.json")},
    }


@pytest.fixture(scope="session", params=MODES)
def hostile(
    request: pytest.FixtureRequest,
    hostile_sims: tuple[SimProcess, SimProcess, SimProcess, SimProcess],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Hostile]:
    """A router in one process mode with the flow running; its quiet p99 measured first."""
    mode: str = request.param
    workdir = tmp_path_factory.mktemp(f"hostile-{mode}")
    (workdir / "state").mkdir()
    router = RouterProcess(
        _config(hostile_sims, workdir, "auto" if mode == "workers" else 1), workdir, mode
    )
    router.start({"HOSTILE_KEYS": KEYS})
    flow = Flow(router.url, workdir / "flow.jsonl")
    try:
        flow.start()
        started = time.monotonic()
        # The quiet run: the flow alone until it has 60 requests behind it.
        wait_sync(lambda: len(flow.records()) >= 60, timeout_s=60, what="a quiet run")
        quiet = flow.window(started, time.monotonic())
        assert not quiet.failures, quiet.failures
        RESULTS.append(Result("(quiet: the flow alone)", mode, quiet, router.rss_bytes()))
        _p0, _d0, p1, d1 = hostile_sims
        yield Hostile(mode, router, flow, Tap(p1, d1), quiet, router.rss_bytes())
    finally:
        flow.stop()
        router.stop()


@pytest.fixture(autouse=True)
def guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Around each case of a test that uses `hostile`: the flow's requests in the case's
    window all succeeded within the p99 bound, the router lives, and its memory is bounded."""
    if "hostile" not in request.fixturenames:
        yield
        return
    h: Hostile = request.getfixturevalue("hostile")
    t0 = time.monotonic()
    yield
    t1 = time.monotonic()
    assert h.router.alive, h.router.log()[-4000:]
    wait_sync(lambda: h.flow.settled_after(t1), timeout_s=40, what="the flow's requests done")
    stats = h.flow.window(t0, t1)
    rss = h.router.rss_bytes()
    h.peak_rss_bytes = max(h.peak_rss_bytes, rss)
    RESULTS.append(Result(request.node.name, h.mode, stats, rss))
    assert not stats.failures, stats.failures[:5]
    assert stats.count >= 1, "no legitimate request ran during the case"
    assert stats.p99_s <= h.p99_bound_s(), (stats, h.quiet)
    assert rss < RSS_LIMIT_BYTES, f"router RSS {rss / 2**20:.0f} MiB"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("hostile clients: the legitimate flow and the router's memory per case")
    tr.line(f"{'case':<70} {'mode':<8} {'n':>4} {'p50 ms':>7} {'p99 ms':>7} {'RSS MiB':>8}")
    for r in RESULTS:
        s = r.stats
        tr.line(
            f"{r.case[:70]:<70} {r.mode:<8} {s.count:>4} {s.p50_s * 1e3:>7.1f} "
            f"{s.p99_s * 1e3:>7.1f} {r.rss_bytes / 2**20:>8.0f}"
        )
