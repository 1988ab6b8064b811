"""Engine verification on the fake clock (DESIGN §10): the health stage and the start-up sweep
against fake engines (small aiohttp apps on loopback whose `/health` status and served model
the test sets), driven pass by pass with `Monitor.run_pass(now)`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from narwhal.clock import FakeClock
from narwhal.config import Role, parse_config
from narwhal.control.health import Answer, HealthResult, verification
from narwhal.server import Router
from narwhal.state.handoff import apply_document
from tests.support.router import router_config


@dataclass
class FakeEngine:
    """`/health` answers `status` (or hangs); `/v1/models` lists `model`, and `adapters`
    as vLLM lists LoRA adapters (with the model as their `parent`)."""

    status: int = 200
    model: str = "demo-model"
    adapters: tuple[str, ...] = ()
    hang: bool = False
    health_calls: int = 0
    server: TestServer | None = None

    def app(self) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            self.health_calls += 1
            if self.hang:
                await asyncio.sleep(3600)
            return web.Response(status=self.status)

        async def models(_: web.Request) -> web.Response:
            cards = [{"id": self.model, "parent": None}]
            cards += [{"id": a, "parent": self.model} for a in self.adapters]
            return web.json_response({"object": "list", "data": cards})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        return app

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")


@dataclass
class World:
    router: Router
    clock: FakeClock
    engines: dict[str, FakeEngine] = field(default_factory=dict)

    async def run_pass(self) -> None:
        self.clock.advance(1.0)
        await self.router.monitor.run_pass(self.clock.monotonic())

    def engine(self, engine_id: str) -> Any:
        return next(e for e in self.router.engines_json() if e["id"] == engine_id)


async def world(tmp_path: Path, roles: dict[str, str], **fakes: FakeEngine) -> World:
    engines = {i: fakes.get(i, FakeEngine()) for i in roles}
    for fake in engines.values():
        fake.server = TestServer(fake.app(), host="127.0.0.1")
        await fake.server.start_server()
    config = parse_config(
        router_config(
            [{"id": i, "url": engines[i].url, "role": r} for i, r in roles.items()],
            tmp_path,
            engine={"health_timeout_s": 0.3},
        )
    )
    Path(config.handoff.path).parent.mkdir(parents=True, exist_ok=True)
    router = Router(config, clock=FakeClock())
    await router.client.start()
    assert isinstance(router.clock, FakeClock)
    return World(router, router.clock, engines)


PD = {"p0": "prefill", "d0": "decode"}


@pytest.fixture
async def cleanup() -> AsyncIterator[list[World]]:
    worlds: list[World] = []
    yield worlds
    for w in worlds:
        await w.router.client.close()
        for fake in w.engines.values():
            assert fake.server is not None
            await fake.server.close()


async def test_a_new_router_is_starting_and_places_nothing(
    tmp_path: Path, cleanup: list[World]
) -> None:
    w = await world(tmp_path, PD)
    cleanup.append(w)
    assert w.router.ready() == "starting: no verified prefill engine"
    assert w.engine("p0")["verified"] is False
    assert w.engine("p0")["unverified_reason"] == "not yet seen healthy"
    assert w.router.fleet.candidates(Role.PREFILL, w.clock.monotonic()) == []
    await w.run_pass()
    assert w.router.ready() is None
    assert w.engine("p0")["verified"] is True and w.engine("p0")["eligible"] is True


async def test_the_only_decode_unhealthy_keeps_decode_starting_until_it_answers_200(
    tmp_path: Path, cleanup: list[World], caplog: pytest.LogCaptureFixture
) -> None:
    w = await world(tmp_path, PD, d0=FakeEngine(status=503))
    cleanup.append(w)
    caplog.set_level(logging.INFO, logger="narwhal.fleet")
    for _ in range(2):
        await w.run_pass()
        assert w.router.ready() == "starting: no verified decode engine"
    d0 = w.engine("d0")
    assert d0["verified"] is False
    assert d0["unverified_reason"] == "waiting for a healthy answer: health answered HTTP 503"
    w.engines["d0"].status = 200
    await w.run_pass()
    assert w.router.ready() is None
    messages = [r.getMessage() for r in caplog.records if "engine d0" in r.getMessage()]
    assert "engine d0: unverified -> in-service (verified: health 200, serves 'demo-model')" in (
        messages
    )
    # the 503s' reason was logged once, not once per pass
    assert sum("HTTP 503" in m and "not verified" in m for m in messages) == 1


async def test_a_wrong_model_stays_unverified_with_one_warning(
    tmp_path: Path, cleanup: list[World], caplog: pytest.LogCaptureFixture
) -> None:
    w = await world(tmp_path, PD, d0=FakeEngine(model="other-model"))
    cleanup.append(w)
    caplog.set_level(logging.WARNING, logger="narwhal.health")
    for _ in range(3):
        await w.run_pass()
    assert w.engine("d0")["verified"] is False
    assert w.engine("d0")["unverified_reason"] == "serves ['other-model'], not 'demo-model'"
    assert w.router.ready() == "starting: no verified decode engine"
    warnings = [r.getMessage() for r in caplog.records if "stays unverified" in r.getMessage()]
    assert warnings == ["engine d0 stays unverified: serves ['other-model'], not 'demo-model'"]


async def test_lora_adapters_are_known_from_models_and_kept_through_a_handoff(
    tmp_path: Path, cleanup: list[World]
) -> None:
    """An adapter (a model card with a `parent`) is served, and known as an adapter (its
    blocks are keyed by its name, DESIGN §11); the handoff carries both lists, so an heir
    serves the adapter from its first request. A document without them (an older router's)
    leaves the lists to the heir's first health check."""
    w = await world(tmp_path, PD, p0=FakeEngine(adapters=("sea-lora",)))
    cleanup.append(w)
    await w.run_pass()
    p0 = w.router.fleet.get("p0")
    assert p0.verified
    assert (p0.served, p0.adapters) == ({"demo-model", "sea-lora"}, {"sea-lora"})
    assert w.router.fleet.get("d0").adapters == frozenset()
    doc = json.loads(await asyncio.to_thread(Path(w.router.config.handoff.path).read_bytes))
    assert doc["engines"]["p0"]["adapters"] == ["sea-lora"]

    heir = Router(w.router.config, clock=FakeClock())
    apply_document(doc, heir.fleet, heir.clock)
    restored = heir.fleet.get("p0")
    assert (restored.served, restored.adapters) == (p0.served, p0.adapters)
    assert heir.fleet.knows_model("sea-lora")

    for saved in doc["engines"].values():
        del saved["served"], saved["adapters"]
    old = Router(w.router.config, clock=FakeClock())
    apply_document(doc, old.fleet, old.clock)
    assert old.fleet.get("p0").verified and old.fleet.get("p0").adapters == frozenset()
    await old.client.start()
    try:
        assert isinstance(old.clock, FakeClock)
        old.clock.advance(1.0)
        await old.monitor.run_pass(old.clock.monotonic())
    finally:
        await old.client.close()
    assert old.fleet.get("p0").adapters == {"sea-lora"}


async def test_a_verified_engine_that_fails_later_is_lost_capacity_not_starting(
    tmp_path: Path, cleanup: list[World]
) -> None:
    w = await world(tmp_path, PD)
    cleanup.append(w)
    await w.run_pass()
    d0 = w.router.fleet.get("d0")
    w.router.lifecycle.eject(d0, "connection", "refused", w.clock.monotonic())
    assert d0.verified is True
    assert w.router.ready() == "no capacity: decode"


async def test_a_unified_fleet_waits_for_a_verified_both_engine(
    tmp_path: Path, cleanup: list[World]
) -> None:
    w = await world(tmp_path, {"u0": "both"}, u0=FakeEngine(status=503))
    cleanup.append(w)
    await w.run_pass()
    assert w.router.ready() == "starting: no verified both engine"


async def test_the_start_up_sweep_verifies_without_evidence_within_the_health_timeout(
    tmp_path: Path, cleanup: list[World]
) -> None:
    """One engine answers 503 and one hangs: the healthy ones are verified, the sweep ends
    at `engine.health_timeout_s` (0.3 s here), and it records no evidence or liveness miss
    (the monitor's first pass, right after, does)."""
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    w = await world(tmp_path, roles, p1=FakeEngine(status=503), d1=FakeEngine(hang=True))
    cleanup.append(w)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await w.router.health.startup_sweep(w.clock.monotonic())
    assert loop.time() - t0 < 0.3 + 0.25
    assert [e.id for e in w.router.fleet if e.verified] == ["p0", "d0"]
    assert w.router.ready() is None
    for engine in w.router.fleet:
        assert engine.evidence == {} and engine.liveness_misses == 0
    assert w.engine("p1")["unverified_reason"].endswith("health answered HTTP 503")


def test_verification_is_a_pure_function_of_the_answer() -> None:
    ok = HealthResult(Answer.OK, status=200)
    assert verification(ok, "m") == (
        False,
        "health 200, served model unknown: /v1/models not read in time",
    )
    models_failed = HealthResult(Answer.OK, status=200, models_problem="answered HTTP 404")
    assert verification(models_failed, "m")[1].endswith("/v1/models answered HTTP 404")
    assert verification(HealthResult(Answer.OK, models=("m", "lora")), "m") == (
        True,
        "health 200, serves 'm'",
    )
    assert verification(HealthResult(Answer.OK, models=("x",)), "m") == (
        False,
        "serves ['x'], not 'm'",
    )
    assert verification(HealthResult(Answer.ERROR, status=503), "m") == (
        False,
        "waiting for a healthy answer: health answered HTTP 503",
    )
    assert verification(HealthResult(Answer.SILENT), "m")[0] is False
