"""The controller stage end to end: performance drift under real load, and role rebalancing.

Real `narwhal-sim` processes; the slow engine is slow by its latency model
(`--ttft-per-token-ms`), prompts are ~50 words (one sim token per word). A load loop runs
through the router the whole time and every request must succeed: the drifting engine is held
(`performance_drift`), its peers take the traffic, and `/admin/stats`, `/admin/engines` and
`/metrics` show it. Rebalancing moves a `kv_both` engine into a role left without capacity
only after it verified the KV transfer of that role for real (DESIGN §3).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.fleet.holds import HoldName
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]
# 50 prompt tokens: 2.5 ms of prefill on a normal sim, 100 ms on the slow one (40x). Placement
# is least-in-flight, so the slow engine carries about one request at a time: at 100 ms it
# completes ~8 prefills per second. A 1 s interval keeps it above drift_min_samples, and 100 ms
# stays above 3x the fast engines' p50 even on a loaded machine, where the router's event loop
# adds 20-40 ms to every measured leg (0.5 s windows held only 3-6 slow samples there).
SLOW_TTFT = ["--ttft-per-token-ms", "2.0"]
CONTROLLER = {
    "interval_s": 1.0,
    "drift_min_samples": 5,
    "drift_intervals": 2,
    "drift_factor": 3,
    "drift_hold_s": 30,
    "drift_mode": "enforce",
}
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
]


def prompt(worker: int, n: int) -> str:
    words = [WORDS[(worker + n + i) % len(WORDS)] for i in range(48)]
    return " ".join([f"w{worker}", f"n{n}", *words])  # 50 words, each prompt distinct


class Load:
    """`workers` clients sending completions back to back, recording every status."""

    def __init__(self, http: aiohttp.ClientSession, url: str, workers: int = 4) -> None:
        self.http = http
        self.url = url
        self.statuses: list[int] = []
        self.failures: list[str] = []
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(workers)]

    async def _worker(self, worker: int) -> None:
        n = 0
        while True:
            n += 1
            body = {"model": "demo-model", "prompt": prompt(worker, n), "max_tokens": 2}
            try:
                async with self.http.post(self.url + "/v1/completions", json=body) as resp:
                    text = await resp.text()
                    self.statuses.append(resp.status)
                    if resp.status != 200:
                        self.failures.append(f"{resp.status}: {text[:200]}")
            except aiohttp.ClientError as exc:
                self.statuses.append(-1)
                self.failures.append(repr(exc))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class StatsWatch:
    """Polls /admin/stats and remembers every drift entry it saw."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url
        self.seen: dict[str, str] = {}
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            async with self.http.get(self.url + "/admin/stats") as resp:
                body = await resp.json()
            for d in body["drift"]:
                self.seen.setdefault(d["engine"], d["reason"])
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def engine_view(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> Any:
    body = await get_json(http, rr.url + "/admin/engines")
    return next(e for e in body["engines"] if e["id"] == engine_id)


def drift_held(rr: RunningRouter, engine_id: str) -> bool:
    engine = rr.router.fleet.get(engine_id)
    return HoldName.PERFORMANCE_DRIFT in engine.active_holds_by_name(rr.router.clock.monotonic())


def completions_seen(sim: SimProcess) -> int:
    return sum(1 for r in sim.requests() if r["path"].endswith("/completions"))


@pytest.mark.slow
async def test_a_slow_prefill_engine_gets_the_drift_hold_while_requests_succeed(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, p2, d0, d1 = sim_factory.start_many(
        [PREFILL, PREFILL, PREFILL + SLOW_TTFT, DECODE, DECODE]
    )
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "p1", "url": p1.url, "role": "prefill"},
            {"id": "p2", "url": p2.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
            {"id": "d1", "url": d1.url, "role": "decode"},
        ],
        controller=CONTROLLER,
    )
    load = Load(http, rr.url)
    watch = StatsWatch(http, rr.url)
    try:
        await eventually(lambda: drift_held(rr, "p2"), timeout_s=15, what="p2 drift hold")
        await eventually(lambda: "p2" in watch.seen, timeout_s=5, what="drift in /admin/stats")

        view = await engine_view(http, rr, "p2")
        assert view["eligible"] is False
        [hold] = view["hold_details"]
        assert hold["name"] == "performance_drift"
        assert "peers' median" in hold["reason"]
        assert hold["deadline"] == pytest.approx(time.time() + 30, abs=5)
        for peer in ("p0", "p1", "d0", "d1"):
            assert (await engine_view(http, rr, peer))["holds"] == []
        assert set(watch.seen) == {"p2"}
        assert "peers' median" in watch.seen["p2"]

        stats = await get_json(http, rr.url + "/admin/stats")
        assert stats["drift_mode"] == "enforce"
        assert stats["interval_s"] == 1.0
        assert stats["consolidation_risk"]["prefill"]["eligible"] == 2

        # Held: once its last requests finished, p2 gets no new work; the peers carry it.
        in_flight = rr.router.fleet.in_flight
        await eventually(lambda: in_flight.of("p2") == 0, timeout_s=5, what="p2 idle")
        p2.clear_requests()
        before = len(load.statuses)
        await eventually(lambda: len(load.statuses) >= before + 40, what="40 more requests")
        assert completions_seen(p2) == 0
        assert completions_seen(p0) > 0 and completions_seen(p1) > 0
    finally:
        await load.stop()
        await watch.stop()

    assert load.failures == []
    assert len(load.statuses) > 40
    async with http.get(rr.url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'narwhal_performance_drift_detected_total{engine="p2"}' in metrics
    assert 'narwhal_holds_active{engine="p2",hold="performance_drift"} 1.0' in metrics


# With two engines the peers' median is the other engine alone. 300 ms of prefill against a
# fast engine's few ms (tens under load) keeps the ratio far above 3 on a loaded machine, and
# 2 s intervals give the slow engine (about one request at a time) over 5 samples each.
VERY_SLOW_TTFT = ["--ttft-per-token-ms", "6.0"]


def windows_seen(rr: RunningRouter) -> list[dict[str, Any]]:
    return [
        {e: (w.latency.total, w.latency.quantile(0.5)) for e, w in window.engines.items()}
        for window in rr.router.stats.closed
    ]


@pytest.mark.slow
async def test_one_slow_engine_of_two_gets_the_drift_hold(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL + VERY_SLOW_TTFT, DECODE])
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "p1", "url": p1.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
        ],
        controller={**CONTROLLER, "interval_s": 2.0},
    )
    load = Load(http, rr.url)
    try:
        try:
            await eventually(lambda: drift_held(rr, "p1"), timeout_s=30, what="p1 drift hold")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; closed windows (samples, p50): {windows_seen(rr)}"
            ) from None
        assert not drift_held(rr, "p0")
    finally:
        await load.stop()
    assert load.failures == []


# --------------------------------------------------------------------------- rebalancing
async def rebalance_setup(
    sim_factory: SimFactory, start_router: StartRouter, d1_kv_role: str
) -> tuple[RunningRouter, SimProcess, SimProcess, SimProcess]:
    p0, d0, d1 = sim_factory.start_many(
        [PREFILL, DECODE, ["--role", "decode", "--kv-role", d1_kv_role]]
    )
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill", "kv_role": "kv_producer"},
            {"id": "d0", "url": d0.url, "role": "decode", "kv_role": "kv_consumer"},
            # Declared kv_both in the config; the process decides what it really does.
            {"id": "d1", "url": d1.url, "role": "decode", "kv_role": "kv_both"},
        ],
        controller={"rebalance_roles": True},
        recovery={"eject_after": 2, "liveness_misses": 2},
    )
    await eventually(lambda: rr.router.monitor.status.passes >= 2, what="two passes")
    assert rr.router.small.rebalances == []
    p0.kill()  # prefill loses its only engine
    return rr, p0, d0, d1


@pytest.mark.slow
async def test_a_kv_both_engine_moves_into_the_empty_role_after_verification(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    rr, _, d0, d1 = await rebalance_setup(sim_factory, start_router, "kv_both")

    async def moved() -> bool:
        return (await engine_view(http, rr, "d1"))["role"] == "prefill"

    await eventually(moved, timeout_s=10, what="d1 moved to prefill")
    stats = await get_json(http, rr.url + "/admin/stats")
    record = stats["rebalances"][-1]
    assert record["engine"] == "d1"
    assert (record["from"], record["to"], record["ok"]) == ("decode", "prefill", True)
    assert (await engine_view(http, rr, "p0"))["ejected"] is True

    # Requests flow again: prefill on d1, decode on d0.
    d0.clear_requests()
    d1.clear_requests()
    body = {"model": "demo-model", "prompt": "after the move", "max_tokens": 3}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    assert [r["leg"] for r in d1.requests() if r["path"].endswith("/completions")] == ["prefill"]
    assert [r["leg"] for r in d0.requests() if r["path"].endswith("/completions")] == ["decode"]
    async with http.get(rr.url + "/ready") as resp:
        assert resp.status == 200, await resp.text()

    # The new role is in the handoff document.
    path = Path(rr.router.config.handoff.path)

    def persisted() -> bool:
        return json.loads(path.read_text())["engines"]["d1"]["role"] == "prefill"

    await eventually(persisted, what="role in the handoff")


@pytest.mark.slow
async def test_a_kv_both_engine_that_cannot_produce_a_handoff_is_not_moved(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    # Declared kv_both, but the process is a kv_consumer: its prefill returns no handoff.
    rr, _, _, _ = await rebalance_setup(sim_factory, start_router, "kv_consumer")

    async def attempted() -> Any:
        stats = await get_json(http, rr.url + "/admin/stats")
        return stats["rebalances"]

    records = await eventually(attempted, timeout_s=10, what="a rebalance attempt")
    assert all(r["engine"] == "d1" and r["ok"] is False for r in records)
    assert records[-1]["to"] == "prefill"
    view = await engine_view(http, rr, "d1")
    assert view["role"] == "decode"
    async with http.get(rr.url + "/ready") as resp:
        assert resp.status == 503
        assert "prefill" in await resp.text()


# --------------------------------------------------------------------------- busiest share
async def narwhal_status(url: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "narwhal.cli.operator", "--url", url, "status",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")},
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


def busiest_share(metrics: str, role: str) -> float | None:
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "narwhal_consolidation_busiest_share" and s.labels["role"] == role:
                return float(s.value)
    return None


@pytest.mark.slow
async def test_busiest_share_follows_traffic_in_metrics_and_status(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    # Two prefill engines share the prefill legs; the one decode engine carries every decode
    # leg, so its role's busiest share is 1.0 once an interval with traffic has closed.
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "p1", "url": p1.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
        ],
        controller={"interval_s": 1.0, "drift_mode": "off"},
    )

    async def scrape() -> str:
        async with http.get(rr.url + "/metrics") as resp:
            return await resp.text()

    idle = await scrape()
    assert busiest_share(idle, "decode") == 0.0  # no closed interval with traffic yet
    load = Load(http, rr.url, workers=2)
    try:

        async def decode_share_is_one() -> bool:
            return busiest_share(await scrape(), "decode") == 1.0

        await eventually(decode_share_is_one, timeout_s=15, what="decode busiest share 1.0")
        prefill = busiest_share(await scrape(), "prefill")
        assert prefill is not None and 0.5 <= prefill <= 1.0

        def share_from_last_interval() -> bool:
            # Counted requests, not an in-flight snapshot (which could only be 0, 1/2 or 1):
            # the controller's share equals the last closed window's split between p0 and p1.
            closed = rr.router.stats.closed[-1].engines
            counts = [closed[e].requests for e in ("p0", "p1") if e in closed]
            share = rr.router.small.risk["prefill"]["busiest_share"]
            return (
                sum(counts) > 0
                and share == pytest.approx(max(counts) / sum(counts))
                and share not in (0.0, 0.5, 1.0)
            )

        await eventually(share_from_last_interval, timeout_s=20, what="a counted prefill share")

        async def status_shows_it() -> str | None:
            out = await narwhal_status(rr.url)
            line = next(x for x in out.splitlines() if x.startswith("consolidation risk:"))
            return line if "decode 1 eligible (HIGH) busiest 100%" in line else None

        line = await eventually(status_shows_it, timeout_s=30, what="share in narwhal status")
        assert "prefill 2 eligible busiest " in line
    finally:
        await load.stop()
    assert load.failures == []
