"""The monitor pass and its failure streak, on a fake clock (spec "Monitoring and readiness",
DESIGN §3).

First a `Monitor` with test stages (plain async functions, some raising on chosen passes):
stage order, stage isolation, error recording and counting, the streak, the degraded reason,
recovery and restart. Then end to end over real loopback sockets: a `Router` whose
`telemetry` stage raises, driven by calling `router.monitor.run_pass` directly, answering
`/ready` and `POST /v1/completions` through aiohttp's test server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from narwhal.clock import FakeClock
from narwhal.config import parse_config
from narwhal.control.monitor import STAGE_ORDER, Monitor
from narwhal.engine.failures import FailureClass
from narwhal.fleet.admission import Admission
from narwhal.server import Router
from narwhal.telemetry.metrics import Metrics
from tests.support.fleet import verify_all
from tests.support.ports import closed_ports
from tests.support.served import serve_http

LIMIT = 3


# --------------------------------------------------------------------------- test stages
@dataclass
class Script:
    """Test stages: every call is logged; `plan[pass_number][stage]` is raised on that pass."""

    plan: dict[int, dict[str, type[Exception]]] = field(default_factory=dict)
    calls: list[tuple[int, str, float]] = field(default_factory=list)
    pass_number: int = 0

    def stages(self) -> dict[str, Any]:
        # Deliberately built in reverse order: the monitor must impose STAGE_ORDER itself.
        return {name: self._stage(name) for name in reversed(STAGE_ORDER)}

    def _stage(self, name: str) -> Any:
        async def stage(now: float) -> None:
            self.calls.append((self.pass_number, name, now))
            exc = self.plan.get(self.pass_number, {}).get(name)
            if exc is not None:
                raise exc(f"{name} broke on pass {self.pass_number}")

        return stage


@dataclass
class Rig:
    clock: FakeClock
    admission: Admission
    metrics: Metrics
    script: Script
    monitor: Monitor

    async def run_pass(self) -> Any:
        self.script.pass_number += 1
        report = await self.monitor.run_pass(self.clock.monotonic())
        self.clock.advance(1.0)
        return report

    def stage_errors(self, stage: str, exc: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "narwhal_monitor_stage_errors_total", {"stage": stage, "exception": exc}
        )
        return value or 0.0

    def streak_gauge(self) -> float | None:
        return self.metrics.registry.get_sample_value("narwhal_monitor_failure_streak")


def make_rig(plan: dict[int, dict[str, type[Exception]]] | None = None, limit: int = LIMIT) -> Rig:
    clock = FakeClock()
    admission = Admission()
    metrics = Metrics()
    script = Script(plan=plan or {})
    monitor = Monitor(script.stages(), limit, admission, metrics, clock)
    return Rig(clock, admission, metrics, script, monitor)


# --------------------------------------------------------------------------- the pass itself
async def test_stage_order_is_the_spec_order() -> None:
    assert STAGE_ORDER == (
        "controller",
        "health",
        "drains",
        "rollover",
        "readmission",
        "liveness",
        "telemetry",
        "handoff",
    )


async def test_stages_run_in_stage_order_with_the_pass_time() -> None:
    rig = make_rig()
    now = rig.clock.monotonic()
    report = await rig.run_pass()
    assert [name for _, name, _ in rig.script.calls] == list(STAGE_ORDER)
    assert {t for _, _, t in rig.script.calls} == {now}
    assert [s.stage for s in report.stages] == list(STAGE_ORDER)
    assert all(s.error is None for s in report.stages)
    assert report.failed is None


async def test_missing_stage_is_refused() -> None:
    stages = make_rig().script.stages()
    del stages["liveness"]
    with pytest.raises(ValueError, match="liveness"):
        Monitor(stages, LIMIT, Admission(), Metrics(), FakeClock())


@pytest.mark.parametrize("failing", STAGE_ORDER)
async def test_a_raising_stage_does_not_stop_the_later_stages(failing: str) -> None:
    rig = make_rig({1: {failing: RuntimeError}})
    report = await rig.run_pass()
    assert [name for _, name, _ in rig.script.calls] == list(STAGE_ORDER)
    errors = {s.stage: s.error for s in report.stages if s.error is not None}
    assert errors == {failing: "RuntimeError"}
    assert report.failed is not None
    assert report.failed.stage == failing
    assert report.failed.detail == f"{failing} broke on pass 1"


async def test_stage_errors_are_recorded_and_counted_by_stage_and_class() -> None:
    rig = make_rig(
        {
            1: {"health": ConnectionError, "handoff": PermissionError},
            2: {"handoff": PermissionError},
            3: {"handoff": OSError},
        }
    )
    for _ in range(3):
        await rig.run_pass()
    assert rig.stage_errors("health", "ConnectionError") == 1
    assert rig.stage_errors("handoff", "PermissionError") == 2
    assert rig.stage_errors("handoff", "OSError") == 1
    assert rig.stage_errors("telemetry", "RuntimeError") == 0
    history = rig.monitor.to_json()["last_passes"]  # newest first
    assert [[s["error"] for s in p["stages"] if not s["ok"]] for p in history] == [
        ["OSError"],
        ["PermissionError"],
        ["ConnectionError", "PermissionError"],
    ]


# --------------------------------------------------------------------------- the streak
async def test_streak_grows_only_on_passes_with_an_error() -> None:
    rig = make_rig({2: {"rollover": KeyError}, 4: {"liveness": ValueError}}, limit=10)
    streaks = []
    for _ in range(4):
        await rig.run_pass()
        streaks.append(rig.monitor.status.streak)
    # pass 3 is clean, so it resets the streak; pass 4 starts a new one
    assert streaks == [0, 1, 0, 1]
    assert rig.streak_gauge() == 1
    assert rig.monitor.status.passes == 4


async def test_a_pass_with_several_errors_counts_once() -> None:
    rig = make_rig({1: {"controller": RuntimeError, "health": RuntimeError, "handoff": OSError}})
    await rig.run_pass()
    assert rig.monitor.status.streak == 1
    assert rig.admission.admitting


async def test_below_the_limit_admission_stays_open() -> None:
    rig = make_rig({n: {"telemetry": RuntimeError} for n in range(1, LIMIT)})
    for n in range(1, LIMIT):
        await rig.run_pass()
        assert rig.monitor.status.streak == n
        assert rig.admission.admitting
        assert rig.admission.reason("monitor") is None
        assert rig.monitor.status.degraded_reason is None


async def test_at_exactly_the_limit_admission_closes_with_the_stage_and_class() -> None:
    rig = make_rig({n: {"telemetry": RuntimeError} for n in range(1, LIMIT + 1)})
    for _ in range(LIMIT - 1):
        await rig.run_pass()
    assert rig.admission.admitting
    await rig.run_pass()
    assert rig.monitor.status.streak == LIMIT
    assert not rig.admission.admitting
    reason = "monitoring degraded: telemetry RuntimeError"
    assert rig.admission.reason("monitor") == reason
    assert rig.admission.closed_reason() == reason
    assert rig.monitor.status.degraded_reason == reason
    assert rig.monitor.to_json()["degraded"] == reason
    assert rig.streak_gauge() == LIMIT


async def test_limit_of_one_degrades_on_the_first_failing_pass() -> None:
    rig = make_rig({1: {"drains": LookupError}}, limit=1)
    await rig.run_pass()
    assert rig.admission.reason("monitor") == "monitoring degraded: drains LookupError"


async def test_reason_is_the_first_failing_stage_of_the_latest_failing_pass() -> None:
    rig = make_rig(
        {
            1: {"health": ValueError, "telemetry": RuntimeError},
            2: {"telemetry": RuntimeError},
            # two stages fail: telemetry comes before handoff in pass order
            3: {"handoff": PermissionError, "telemetry": KeyError},
            # the reason follows the latest failing pass, not the first one that degraded
            4: {"controller": OSError, "handoff": PermissionError},
            5: {"liveness": TimeoutError, "handoff": PermissionError},
        }
    )
    reasons = []
    for _ in range(5):
        await rig.run_pass()
        reasons.append(rig.admission.reason("monitor"))
    assert reasons == [
        None,
        None,
        "monitoring degraded: telemetry KeyError",
        "monitoring degraded: controller OSError",
        "monitoring degraded: liveness TimeoutError",
    ]
    assert rig.monitor.status.streak == 5
    # monitoring stays active while degraded: every stage ran on every pass
    assert len(rig.script.calls) == 5 * len(STAGE_ORDER)


async def test_one_fully_successful_pass_resets_the_streak_and_reopens_admission() -> None:
    rig = make_rig({n: {"handoff": PermissionError} for n in range(1, LIMIT + 3)})
    for _ in range(LIMIT + 2):
        await rig.run_pass()
    assert not rig.admission.admitting
    assert rig.monitor.status.streak == LIMIT + 2
    report = await rig.run_pass()  # pass LIMIT + 3: clean
    assert report.failed is None
    assert rig.monitor.status.streak == 0
    assert rig.monitor.status.degraded_reason is None
    assert rig.admission.admitting
    assert rig.admission.reason("monitor") is None
    assert rig.streak_gauge() == 0
    # and the streak starts over from zero: one more failure is far below the limit
    rig.script.plan[LIMIT + 4] = {"handoff": PermissionError}
    await rig.run_pass()
    assert rig.monitor.status.streak == 1
    assert rig.admission.admitting


async def test_a_clean_pass_reopens_only_the_monitors_closure() -> None:
    rig = make_rig({n: {"health": RuntimeError} for n in range(1, LIMIT + 1)})
    rig.admission.close("lease", "standby: lease held by router-b")
    for _ in range(LIMIT):
        await rig.run_pass()
    assert rig.admission.closed_reason() == "standby: lease held by router-b"
    await rig.run_pass()
    assert rig.admission.reason("monitor") is None
    assert not rig.admission.admitting
    assert rig.admission.closed_reason() == "standby: lease held by router-b"


async def test_a_fresh_monitor_starts_at_streak_zero() -> None:
    plan = {n: {"telemetry": RuntimeError} for n in range(1, 10)}
    before = make_rig(plan)
    for _ in range(LIMIT + 1):
        await before.run_pass()
    assert before.monitor.status.streak == LIMIT + 1
    assert not before.admission.admitting
    # a restart builds everything anew
    after = make_rig(plan)
    assert after.monitor.status.streak == 0
    assert after.monitor.status.passes == 0
    assert after.monitor.status.degraded_reason is None
    assert after.admission.admitting
    assert after.monitor.to_json()["streak"] == 0
    # and it needs a full LIMIT failing passes of its own to degrade
    for _ in range(LIMIT - 1):
        await after.run_pass()
    assert after.admission.admitting


# --------------------------------------------------------------------------- end to end
class Telemetry:
    """A replacement `telemetry` stage that raises while `broken`."""

    def __init__(self) -> None:
        self.broken = True
        self.calls = 0

    async def __call__(self, now: float) -> None:
        self.calls += 1
        if self.broken:
            raise RuntimeError("telemetry exporter down")


@dataclass
class Served:
    router: Router
    clock: FakeClock
    http: aiohttp.ClientSession
    telemetry: Telemetry

    async def run_pass(self) -> Any:
        report = await self.router.monitor.run_pass(self.clock.monotonic())
        self.clock.advance(self.router.config.controller.monitor_interval_s)
        return report


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    p_port, d_port = closed_ports(2)
    config = parse_config(
        {
            "model": "demo-model",
            "engines": [
                {"id": "p0", "url": f"http://127.0.0.1:{p_port}", "role": "prefill"},
                {"id": "d0", "url": f"http://127.0.0.1:{d_port}", "role": "decode"},
            ],
            "engine": {"health_timeout_s": 2.0},
            "controller": {"monitor_failure_limit": LIMIT},
            # keep the engines in placement for the whole test despite failing health
            "recovery": {"eject_after": 100, "liveness_misses": 100},
            "handoff": {"path": str(tmp_path / "handoff.json")},
        }
    )
    clock = FakeClock()
    telemetry = Telemetry()
    router = Router(config, clock=clock, stage_overrides={"telemetry": telemetry})
    verify_all(router.fleet)  # a serving fleet, already seen healthy
    await router.client.start()
    try:
        async with serve_http(router) as http:
            yield Served(router, clock, http, telemetry)
    finally:
        await router.client.close()


async def ready(s: Served) -> tuple[int, str]:
    resp = await s.http.get("/ready")
    return resp.status, await resp.text()


async def test_ready_before_any_pass(served: Served) -> None:
    assert await ready(served) == (200, "ready")


async def test_degraded_router_answers_503_on_ready_and_completions(served: Served) -> None:
    for n in range(1, LIMIT):
        report = await served.run_pass()
        assert [s.stage for s in report.stages if s.error] == ["telemetry"]
        assert served.router.monitor.status.streak == n
        assert await ready(served) == (200, "ready")

    report = await served.run_pass()
    assert served.router.monitor.status.streak == LIMIT
    assert served.telemetry.calls == LIMIT

    status, body = await ready(served)
    assert status == 503
    assert body == "monitoring degraded: telemetry RuntimeError"
    assert served.router.ready() == "monitoring degraded: telemetry RuntimeError"

    resp = await served.http.post(
        "/v1/completions", json={"model": "demo-model", "prompt": "hi", "max_tokens": 4}
    )
    assert resp.status == 503
    assert resp.headers["Content-Type"].startswith("application/json")
    assert resp.headers.get("Retry-After") == "1"
    payload = await resp.json()
    assert set(payload) == {"error"}
    error = payload["error"]
    assert isinstance(error["message"], str)
    assert "monitoring degraded: telemetry RuntimeError" in error["message"]
    assert error["type"] == "service_unavailable"
    assert error["code"] == 503

    resp = await served.http.post(
        "/v1/chat/completions",
        json={"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status == 503
    assert "error" in await resp.json()

    metrics = await (await served.http.get("/metrics")).text()
    assert (
        'narwhal_monitor_stage_errors_total{exception="RuntimeError",stage="telemetry"} 3.0'
        in metrics
    )
    assert "narwhal_monitor_failure_streak 3.0" in metrics
    assert "narwhal_admitting 0.0" in metrics

    monitor = await (await served.http.get("/admin/monitor")).json()
    assert monitor["degraded"] == "monitoring degraded: telemetry RuntimeError"
    assert monitor["admitting"] is False


async def test_health_stage_on_closed_ports_records_evidence_and_does_not_raise(
    served: Served,
) -> None:
    for _ in range(2):
        report = await served.run_pass()
        by_stage = {s.stage: s for s in report.stages}
        assert by_stage["health"].error is None
        assert by_stage["liveness"].error is None
        assert by_stage["handoff"].error is None
        assert by_stage["telemetry"].error == "RuntimeError"
    for engine_id in ("p0", "d0"):
        engine = served.router.fleet.get(engine_id)
        assert engine.evidence == {FailureClass.CONNECTION: 2}
        assert engine.liveness_misses == 2
        assert engine.ejected is None


async def test_a_clean_pass_lifts_the_degraded_state(served: Served) -> None:
    for _ in range(LIMIT + 1):
        await served.run_pass()
    assert (await ready(served))[0] == 503
    assert not served.router.admission.admitting

    served.telemetry.broken = False
    report = await served.run_pass()
    assert report.failed is None
    assert served.router.monitor.status.streak == 0
    assert served.router.admission.admitting
    status, body = await ready(served)
    assert "degraded" not in body
    assert (status, body) == (200, "ready")


async def test_degraded_reason_precedes_no_capacity_on_ready(served: Served) -> None:
    router = served.router
    for _ in range(LIMIT):
        await served.run_pass()
    now = served.clock.monotonic()
    router.lifecycle.eject(router.fleet.get("p0"), "connection", "refused", now)
    assert await ready(served) == (503, "monitoring degraded: telemetry RuntimeError")
    served.telemetry.broken = False
    await served.run_pass()
    assert await ready(served) == (503, "no capacity: prefill")


async def test_a_restarted_router_starts_with_a_fresh_streak(served: Served) -> None:
    for _ in range(LIMIT):
        await served.run_pass()
    assert served.router.ready() == "monitoring degraded: telemetry RuntimeError"
    restarted = Router(served.router.config, clock=served.clock)
    assert restarted.monitor.status.streak == 0
    assert restarted.admission.admitting
    # Not degraded: a restart without --resume only waits to see its engines healthy again.
    assert restarted.ready() == "starting: no verified prefill engine"
