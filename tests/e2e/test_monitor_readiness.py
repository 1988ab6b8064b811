"""Monitoring and readiness end to end: a real I/O fault in the handoff stage degrades `/ready`.

The router runs on a loopback port against narwhal-sim processes; the fault is real: the
handoff destination's directory is removed (or replaced by a regular file) while the monitor
writes `handoff.path` every pass. Spec chapter "Failure, readmission, and state", section
"Monitoring and readiness"; DESIGN §3.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.control.monitor import STAGE_ORDER
from tests.support.fs import remove_live_dir
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

PREFILL = ("--role", "prefill", "--kv-role", "kv_producer")
DECODE = ("--role", "decode", "--kv-role", "kv_consumer")
LIMIT = 3


def engines(prefill: SimProcess, decode: SimProcess) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": prefill.url, "role": "prefill"},
        {"id": "d0", "url": decode.url, "role": "decode"},
    ]


async def get_text(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url) as resp:
        return resp.status, await resp.text()


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def complete(
    http: aiohttp.ClientSession, rr: RunningRouter, *, stream: bool = False, max_tokens: int = 4
) -> tuple[int, bytes, dict[str, str]]:
    body = {"model": "demo-model", "prompt": "monitoring keeps going", "max_tokens": max_tokens,
            "stream": stream}  # fmt: skip
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when the series does not exist)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def assert_degraded_error(status: int, raw: bytes, headers: dict[str, str], reason: str) -> None:
    """A refused admission is an OpenAI-style 503 naming the reason, with Retry-After."""
    assert status == 503, raw
    error = json.loads(raw)["error"]
    assert error["code"] == 503
    assert error["type"] == "service_unavailable"
    assert reason in error["message"]
    assert "Retry-After" in headers


async def wait_ready(http: aiohttp.ClientSession, rr: RunningRouter) -> None:
    async def probe() -> bool:
        return await get_text(http, rr.url + "/ready") == (200, "ready")

    await eventually(probe, timeout_s=10, what="/ready 200 ready")


async def wait_passes(http: aiohttp.ClientSession, rr: RunningRouter, more: int) -> dict[str, Any]:
    """Wait until the monitor ran `more` further passes; returns /admin/monitor then."""
    start = (await get_json(http, rr.url + "/admin/monitor"))["passes"]

    async def probe() -> dict[str, Any] | None:
        mon = await get_json(http, rr.url + "/admin/monitor")
        return mon if mon["passes"] >= start + more else None

    return await eventually(probe, timeout_s=10, what=f"{more} more monitor passes")


class Watch:
    """Samples the router every 5 ms: (streak, degraded reason, admitting) in one loop turn.

    The three are read without an await in between, so each sample is a consistent snapshot
    of the monitor and admission (what `/ready` and the data plane would see at that instant).
    """

    def __init__(self, rr: RunningRouter) -> None:
        self.rr = rr
        self.samples: list[tuple[int, str | None, bool]] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        router = self.rr.router
        while True:
            self.samples.append(
                (router.monitor.status.streak, router.ready(), router.admission.admitting)
            )
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


# --------------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_removed_handoff_directory_degrades_then_one_clean_pass_recovers(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([[*PREFILL, "--itl-ms", "30"],
                                              [*DECODE, "--itl-ms", "30"]])  # fmt: skip
    rr = await start_router(engines(prefill, decode), controller={"monitor_failure_limit": LIMIT})
    await wait_ready(http, rr)
    state_dir = rr.router.handoff.path.parent
    await eventually(rr.router.handoff.path.exists, what="the first handoff written")

    # A slow stream (100 tokens, 30 ms apart: ~3 s) admitted before the fault.
    stream = asyncio.create_task(complete(http, rr, stream=True, max_tokens=100))
    await eventually(lambda: rr.router.fleet.in_flight.of("d0") == 1, what="stream on d0")

    watch = Watch(rr)
    remove_live_dir(state_dir)
    reason = "monitoring degraded: handoff FileNotFoundError"

    async def degraded() -> bool:
        return await get_text(http, rr.url + "/ready") == (503, reason)

    await eventually(degraded, timeout_s=5, what=reason)
    assert not stream.done(), "the stream must still be running when admission closes"

    mon = await get_json(http, rr.url + "/admin/monitor")
    assert mon["degraded"] == reason
    assert mon["admitting"] is False
    assert mon["streak"] >= LIMIT
    failing = mon["last_passes"][0]
    assert failing["ok"] is False
    by_stage = {s["stage"]: s for s in failing["stages"]}
    assert by_stage["handoff"]["ok"] is False
    assert by_stage["handoff"]["error"] == "FileNotFoundError"
    assert all(by_stage[s]["ok"] for s in STAGE_ORDER if s != "handoff")

    # New completions (plain and streamed) are refused with an OpenAI error body.
    for stream_flag in (False, True):
        status, raw, headers = await complete(http, rr, stream=stream_flag)
        assert_degraded_error(status, raw, headers, reason)

    # Monitoring stays active while degraded: passes keep coming, all failing at handoff.
    mon = await wait_passes(http, rr, 3)
    assert mon["degraded"] == reason
    assert mon["streak"] >= LIMIT + 3

    # The stream admitted before degradation runs to completion with its terminal marker.
    status, raw, _ = await stream
    assert status == 200
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    assert b'"error"' not in raw
    assert raw.count(b'"text"') == 100

    # Counters: one stage error per failing pass, and the streak gauge.
    _, metrics_text = await get_text(http, rr.url + "/metrics")
    errors = metric(
        metrics_text, "narwhal_monitor_stage_errors_total", stage="handoff",
        exception="FileNotFoundError",
    )  # fmt: skip
    assert errors >= LIMIT + 3
    assert metric(metrics_text, "narwhal_monitor_failure_streak") >= LIMIT + 3
    assert metric(metrics_text, "narwhal_ready") == 0
    assert metric(metrics_text, "narwhal_admitting") == 0

    # Re-create the directory: the next fully successful pass clears the streak and reopens.
    state_dir.mkdir()
    await wait_ready(http, rr)
    mon = await get_json(http, rr.url + "/admin/monitor")
    assert mon["streak"] == 0
    assert mon["degraded"] is None
    assert mon["admitting"] is True
    status, raw, _ = await complete(http, rr)
    assert status == 200, raw
    assert rr.router.handoff.path.exists()
    await watch.stop()

    # Every consistent snapshot: admission closed exactly when the streak reached the limit.
    streaks = {s for s, _, _ in watch.samples}
    assert {1, 2} <= streaks, "the streak must be seen climbing below the limit"
    for streak, ready_reason, admitting in watch.samples:
        if streak >= LIMIT:
            assert (ready_reason, admitting) == (reason, False)
        else:
            assert (ready_reason, admitting) == (None, True), (streak, ready_reason)
    # The recovery took one clean pass: the streak went from >= LIMIT straight to 0.
    after = [s for s, _, _ in watch.samples]
    last_failing = max(i for i, s in enumerate(after) if s >= LIMIT)
    assert all(s == 0 for s in after[last_failing + 1 :])


async def test_handoff_directory_replaced_by_a_file_reports_the_os_error_class(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    rr = await start_router(engines(prefill, decode), controller={"monitor_failure_limit": LIMIT})
    await wait_ready(http, rr)
    state_dir = rr.router.handoff.path.parent

    # What the OS raises for a write below a regular file, observed directly.
    remove_live_dir(state_dir)
    state_dir.write_text("not a directory")
    with pytest.raises(OSError) as observed:
        (state_dir / ".probe").write_bytes(b"x")
    cls = type(observed.value).__name__
    assert cls == "NotADirectoryError"
    reason = f"monitoring degraded: handoff {cls}"

    async def degraded() -> bool:
        return await get_text(http, rr.url + "/ready") == (503, reason)

    await eventually(degraded, timeout_s=5, what=reason)
    status, raw, headers = await complete(http, rr)
    assert_degraded_error(status, raw, headers, reason)
    mon = await get_json(http, rr.url + "/admin/monitor")
    handoff = next(s for s in mon["last_passes"][0]["stages"] if s["stage"] == "handoff")
    assert handoff["error"] == cls

    state_dir.unlink()
    state_dir.mkdir()
    await wait_ready(http, rr)
    status, raw, _ = await complete(http, rr)
    assert status == 200, raw


async def test_admin_monitor_shows_passes_stages_streak_and_admission(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    # Every health check of d0 takes 150 ms (within the 500 ms health timeout).
    decode.add_fault({"kind": "health_hang", "delay_s": 0.15})
    rr = await start_router(engines(prefill, decode), controller={"monitor_failure_limit": LIMIT})
    mon = await wait_passes(http, rr, 2)

    assert mon["streak"] == 0
    assert mon["failure_limit"] == LIMIT
    assert mon["admitting"] is True
    assert mon["degraded"] is None
    passes = mon["last_passes"]
    assert len(passes) >= 2
    numbers = [p["pass"] for p in passes]
    assert numbers == sorted(numbers, reverse=True), "newest pass first"
    assert numbers[0] == mon["passes"]
    for p in passes:
        assert p["ok"] is True
        assert isinstance(p["started_at"], float)
        assert [s["stage"] for s in p["stages"]] == list(STAGE_ORDER)
        for s in p["stages"]:
            assert s["ok"] is True and s["error"] is None
            assert isinstance(s["duration_s"], float) and s["duration_s"] >= 0
        health = next(s for s in p["stages"] if s["stage"] == "health")
        assert health["duration_s"] >= 0.14, "the stage's real duration is reported"

    # Degrade: the failing stage, its outcome, the streak and the closed admission show up.
    state_dir = rr.router.handoff.path.parent
    remove_live_dir(state_dir)

    async def degraded() -> dict[str, Any] | None:
        m = await get_json(http, rr.url + "/admin/monitor")
        return m if m["streak"] >= LIMIT else None

    mon = await eventually(degraded, timeout_s=5, what="streak at the limit")
    assert mon["admitting"] is False
    assert mon["degraded"] == "monitoring degraded: handoff FileNotFoundError"
    newest = mon["last_passes"][0]
    assert newest["ok"] is False
    handoff = newest["stages"][-1]
    assert handoff["stage"] == "handoff"
    assert handoff["ok"] is False
    assert handoff["error"] == "FileNotFoundError"
    assert handoff["detail"]
    state_dir.mkdir()
    await wait_ready(http, rr)


@pytest.mark.slow
async def test_a_failing_stage_does_not_stop_the_rest_of_the_pass(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The controller stage raises on every pass; later stages keep doing their real work."""
    prefill, decode, decode2 = sim_factory.start_many([list(PREFILL), list(DECODE), list(DECODE)])
    broken = {"controller": True}
    cell: dict[str, Any] = {}

    async def controller(now: float) -> None:
        if broken["controller"]:
            raise RuntimeError("controller broke")
        await cell["router"].small.controller(now)

    rr = await start_router(
        [*engines(prefill, decode), {"id": "d1", "url": decode2.url, "role": "decode"}],
        controller={"monitor_failure_limit": LIMIT},
        recovery={"liveness_misses": 2, "eject_after": 10},
        engine={"health_timeout_s": 0.2},
        router_kwargs={"stage_overrides": {"controller": controller}},
    )
    cell["router"] = rr.router
    reason = "monitoring degraded: controller RuntimeError"

    async def degraded() -> bool:
        return await get_text(http, rr.url + "/ready") == (503, reason)

    await eventually(degraded, timeout_s=5, what=reason)
    written = rr.router.handoff.sequence

    # Health and liveness still run: a killed engine is still found and ejected.
    decode2.kill()

    async def ejected() -> dict[str, Any] | None:
        body = await get_json(http, rr.url + "/admin/engines")
        d1 = next(e for e in body["engines"] if e["id"] == "d1")
        return d1["ejection"]

    record = await eventually(ejected, timeout_s=5, what="d1 ejected")
    assert record["cause"] == "liveness"
    # The handoff stage, after the failing one, still writes every pass.
    assert rr.router.handoff.sequence > written
    mon = await get_json(http, rr.url + "/admin/monitor")
    for p in mon["last_passes"]:
        outcome = {s["stage"]: s["ok"] for s in p["stages"]}
        assert outcome == {s: s != "controller" for s in STAGE_ORDER}

    # Two failing stages: the reason names the first in pass order.
    state_dir = rr.router.handoff.path.parent
    remove_live_dir(state_dir)
    await wait_passes(http, rr, 2)
    assert await get_text(http, rr.url + "/ready") == (503, reason)

    # The controller recovers but the handoff still fails: the reason follows the latest
    # failing pass, and admission stays closed (no fully successful pass happened).
    broken["controller"] = False
    handoff_reason = "monitoring degraded: handoff FileNotFoundError"

    async def switched() -> bool:
        return await get_text(http, rr.url + "/ready") == (503, handoff_reason)

    await eventually(switched, timeout_s=5, what=handoff_reason)
    assert rr.router.monitor.status.streak >= LIMIT
    state_dir.mkdir()
    await wait_ready(http, rr)


async def test_a_restarted_router_starts_with_a_fresh_streak_and_admits(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    first = await start_router(engines(prefill, decode), controller={"monitor_failure_limit": 2})
    state_dir = first.router.handoff.path.parent
    remove_live_dir(state_dir)

    async def degraded() -> bool:
        status, _ = await get_text(http, first.url + "/ready")
        return status == 503

    await eventually(degraded, timeout_s=5, what="first router degraded")
    assert first.router.monitor.status.streak >= 2
    await first.stop()

    state_dir.mkdir(exist_ok=True)
    second = await start_router(engines(prefill, decode), controller={"monitor_failure_limit": 2})
    assert second.router.monitor.status.streak == 0
    mon = await get_json(http, second.url + "/admin/monitor")
    assert mon["streak"] == 0 and mon["admitting"] is True and mon["degraded"] is None
    status, raw, _ = await complete(http, second)
    assert status == 200, raw
    await wait_ready(http, second)


async def test_resume_restores_state_but_never_the_monitor_failure_streak(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A degraded router keeps writing its handoff (telemetry fails, not the handoff);
    a router resuming from that handoff still starts with a zero streak and admits."""
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])

    async def telemetry(now: float) -> None:
        raise ValueError("telemetry broke")

    first = await start_router(
        engines(prefill, decode),
        controller={"monitor_failure_limit": 2},
        router_kwargs={"stage_overrides": {"telemetry": telemetry}},
    )

    async def degraded() -> bool:
        return await get_text(http, first.url + "/ready") == (
            503, "monitoring degraded: telemetry ValueError")  # fmt: skip

    await eventually(degraded, timeout_s=5, what="first router degraded")
    await wait_passes(http, first, 1)
    await first.stop()
    saved_sequence = first.router.handoff.sequence
    assert first.router.handoff.last_document is not None

    second = await start_router(
        engines(prefill, decode),
        controller={"monitor_failure_limit": 2},
        router_kwargs={"resume": True},
    )
    verdict = second.router.resume_verdict
    assert verdict is not None and verdict.ok, verdict
    assert second.router.monitor.status.streak == 0
    status, raw, _ = await complete(http, second)
    assert status == 200, raw
    await wait_ready(http, second)
    assert second.router.handoff.sequence > saved_sequence


async def test_a_standby_counts_the_degraded_ready_toward_takeover(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:  # fmt: skip
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    (tmp_path / "lease").mkdir()
    lease = {"backend": "file", "path": str(tmp_path / "lease" / "lease.json"), "ttl_s": 3.0,
             "renew_interval_s": 0.5}  # fmt: skip
    active = await start_router(
        engines(prefill, decode), lease=lease, router_id="router-a",
        controller={"monitor_failure_limit": 2},
    )  # fmt: skip
    await wait_ready(http, active)
    standby = await start_router(
        engines(prefill, decode), lease=lease, router_id="router-b",
        standby={"active_url": active.url, "takeover_threshold": 3},
        router_kwargs={"standby": True},
    )  # fmt: skip

    async def lease_of(rr: RunningRouter) -> dict[str, Any]:
        return dict(await get_json(http, rr.url + "/admin/lease"))

    # While the active is ready, the standby counts nothing and stays standby.
    await wait_passes(http, active, 5)
    info = await lease_of(standby)
    assert info["active_failures"] == 0
    assert info["role"] == "standby"

    remove_live_dir(active.router.handoff.path.parent)
    seen: list[int] = []

    async def taken_over() -> bool:
        info = await lease_of(standby)
        seen.append(info["active_failures"])
        return bool(info["role"] == "active")

    await eventually(taken_over, timeout_s=10, what="standby takes the lease")
    assert max(seen) >= 1, "the degraded /ready counted toward the threshold"
