"""Membership changes while the router runs (DESIGN §10, issue 19): engines added and removed
through the admin API and the `narwhal engines` CLI, over real `narwhal-sim` processes.

An added engine is unverified until its first healthy answer, then takes work; a removed one
takes no new work at once, is never ejected or charged for leaving, and is forgotten once its
requests settled. Under steady load through every change, no request fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.support.cli import narwhal
from tests.support.http import metric, metric_sum
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "5"]


@pytest.fixture
def sims() -> Iterator[list[SimProcess]]:
    """p0, d0 (configured) and d1, d2 (not yet)."""
    factory = SimFactory()
    try:
        yield factory.start_many([P, D, D, D])
    finally:
        factory.close()


def _spec(engine_id: str, sim: SimProcess, role: str) -> dict[str, Any]:
    return {"id": engine_id, "url": sim.url, "role": role}


async def _router(start_router: StartRouter, sims: list[SimProcess]) -> RunningRouter:
    return await start_router(
        [_spec("p0", sims[0], "prefill"), _spec("d0", sims[1], "decode")],
        serving={"policy": "bounded"},
        controller={"monitor_interval_s": 0.1},
    )


async def _engines(http: aiohttp.ClientSession, rr: RunningRouter) -> dict[str, Any]:
    async with http.get(rr.url + "/admin/engines") as resp:
        return {e["id"]: e for e in (await resp.json())["engines"]}


async def _in_service(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> None:
    async def eligible() -> bool:
        engine = (await _engines(http, rr)).get(engine_id)
        return engine is not None and engine["eligible"]

    await eventually(eligible, timeout_s=10, what=f"{engine_id} in service")


async def _gone(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> None:
    async def forgotten() -> bool:
        return engine_id not in await _engines(http, rr)

    await eventually(forgotten, timeout_s=10, what=f"{engine_id} forgotten")


@dataclass
class Load:
    """Streaming requests from `clients` loops until stopped: every outcome is kept."""

    url: str
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, http: aiohttp.ClientSession, n: int) -> None:
        body = {"model": "demo-model", "prompt": f"load {n}", "max_tokens": 8, "stream": True}
        while not self.stop.is_set():
            async with http.post(self.url + "/v1/completions", json=body) as resp:
                raw = await resp.read()
            if resp.status == 200 and raw.rstrip().endswith(b"data: [DONE]"):
                self.ok += 1
            else:
                self.failed.append(f"{resp.status}: {raw[-200:]!r}")


@pytest.fixture
async def load(http: aiohttp.ClientSession) -> AsyncIterator[Any]:
    tasks: list[asyncio.Task[None]] = []
    loads: list[Load] = []

    async def start(rr: RunningRouter, clients: int = 4) -> Load:
        running = Load(rr.url)
        loads.append(running)
        tasks.extend(asyncio.create_task(running.client(http, i)) for i in range(clients))
        return running

    yield start
    for running in loads:
        running.stop.set()
    await asyncio.gather(*tasks)


async def test_engines_added_and_removed_under_load_fail_no_request(
    sims: list[SimProcess],
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    load: Any,
) -> None:
    rr = await _router(start_router, sims)
    running: Load = await load(rr)
    await eventually(lambda: running.ok >= 20, timeout_s=10, what="load flowing")

    async with http.post(rr.url + "/admin/engines", json=_spec("d1", sims[2], "decode")) as resp:
        assert resp.status == 201, await resp.text()
        assert await resp.json() == {"engine": "d1", "change": "added", "state": "unverified"}
    await _in_service(http, rr, "d1")
    sims[2].clear_requests()
    await eventually(lambda: len(sims[2].requests()) >= 5, timeout_s=10, what="d1 takes work")

    async with http.delete(rr.url + "/admin/engines/d0") as resp:
        assert resp.status in (200, 202), await resp.text()
        assert (await resp.json())["change"] in ("removed", "removing")
    await _gone(http, rr, "d0")
    sims[1].clear_requests()
    before = running.ok
    await eventually(lambda: running.ok >= before + 20, timeout_s=10, what="load after removal")
    running.stop.set()

    assert running.failed == []
    assert not [r for r in sims[1].requests() if r["path"] != "/health"]  # d0 takes no work
    assert sims[1].running  # removed, not killed
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    assert metric_sum(text, "narwhal_ejections_total", engine="d0") == 0
    assert metric_sum(text, "narwhal_engine_failures_total", engine="d0") == 0
    changes = "narwhal_membership_changes_total"
    assert metric_sum(text, changes, change="added", source="operator") == 1
    assert metric_sum(text, changes, change="removed", source="operator") == 1


async def test_a_removed_engine_is_forgotten_only_once_its_stream_ended(
    sims: list[SimProcess], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A stream in flight on the removed decode runs to its end there, and the engine is
    forgotten after it. With `force` it is forgotten at once, and its stream still ends
    normally (the engine is alive; what its leg reports is ignored)."""
    rr = await _router(start_router, sims)
    async with http.post(rr.url + "/admin/engines", json=_spec("d1", sims[2], "decode")) as r:
        assert r.status == 201
    await _in_service(http, rr, "d1")
    # 3 s of stream at the sims' 5 ms: a look at the engines and the DELETE must come while it
    # runs (0.5 s was once too short on a loaded host: the removal found it ended, 200).
    body = {"model": "demo-model", "prompt": "long", "max_tokens": 600, "stream": True}
    for force in (False, True):
        async with http.post(rr.url + "/v1/completions", json=body) as stream:
            await stream.content.readuntil(b"\n\n")
            engines = await _engines(http, rr)
            (serving,) = [e for e in ("d0", "d1") if e in engines and engines[e]["in_flight"]]
            suffix = "?force=true" if force else ""
            async with http.delete(f"{rr.url}/admin/engines/{serving}{suffix}") as resp:
                answer = await resp.json()
            if force:
                assert (resp.status, answer) == (200, {"engine": serving, "change": "removed"})
                assert serving not in await _engines(http, rr)
            else:
                assert resp.status == 202
                assert answer == {"engine": serving, "change": "removing", "in_flight": 1}
                engine = (await _engines(http, rr))[serving]
                assert engine["eligible"] is False and engine["ejected"] is False
            rest = await stream.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
        await _gone(http, rr, serving)
    assert set(await _engines(http, rr)) == {"p0"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{", 400, None),
        (b'{"id": "d9", "role": "decode"}', 400, "url"),
        (b'{"id": "d9", "url": "http://127.0.0.1:1", "role": "sideways"}', 400, "role"),
        (b'{"id": "d9", "url": "http://127.0.0.1:1", "role": "decode", "x": 1}', 400, "x"),
        (b'{"id": "p0", "url": "http://127.0.0.1:1", "role": "decode"}', 409, None),
        (
            b'{"id": "d9", "url": "http://127.0.0.1:1", "role": "decode", "api": "llamacpp"}',
            409,
            None,
        ),
    ],
)
async def test_a_bad_addition_is_refused_and_changes_nothing(
    body: bytes,
    status: int,
    param: str | None,
    sims: list[SimProcess],
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    rr = await _router(start_router, sims)
    async with http.post(rr.url + "/admin/engines", data=body) as resp:
        assert resp.status == status, await resp.text()
        error = (await resp.json())["error"]
    if param is not None:
        assert error["param"] == param
    assert set(await _engines(http, rr)) == {"p0", "d0"}


async def test_the_same_url_twice_and_unknown_or_bad_removals_are_refused(
    sims: list[SimProcess], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(start_router, sims)
    async with http.post(rr.url + "/admin/engines", json=_spec("d9", sims[1], "decode")) as r:
        assert r.status == 409 and "url" in (await r.json())["error"]["message"]
    async with http.delete(rr.url + "/admin/engines/zz") as resp:
        assert resp.status == 404
    async with http.delete(rr.url + "/admin/engines/d0?force=maybe") as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "force"
    assert set(await _engines(http, rr)) == {"p0", "d0"}


async def test_the_cli_follows_an_addition_and_a_removal_until_they_took_effect(
    sims: list[SimProcess], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(start_router, sims)
    cli = await narwhal("engines", "add", "d1", sims[2].url, "--role", "decode", "--url", rr.url)
    assert cli.code == 0, cli.err
    lines = cli.out.splitlines()
    assert lines[0] == "d1: added (unverified)"
    assert lines[-1] == "d1: in service"
    assert (await _engines(http, rr))["d1"]["eligible"]

    cli = await narwhal("engines", "remove", "d1", "--url", rr.url)
    assert cli.code == 0, cli.err
    assert cli.out.splitlines()[-1] == "d1: removed"
    assert "d1" not in await _engines(http, rr)

    cli = await narwhal("engines", "remove", "d1", "--url", rr.url)
    assert cli.code == 1 and "404" in cli.err
    assert await metric(http, rr.url, "narwhal_membership_changes_total", change="added") == 1


async def test_a_standby_follows_the_membership_and_serves_it_after_takeover(
    sims: list[SimProcess], start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Any
) -> None:
    """The handoff records the membership (each engine's url, role, kv_role and api): the
    standby adds and forgets engines as the active did, and after a takeover it places work
    on the engine the active added."""
    lease = {
        "backend": "file",
        "path": str(tmp_path / "state" / "lease.json"),
        "ttl_s": 1.5,
        "renew_interval_s": 0.3,
    }
    engines = [_spec("p0", sims[0], "prefill"), _spec("d0", sims[1], "decode")]
    sections = {"controller": {"monitor_interval_s": 0.1}, "lease": lease}
    active = await start_router(engines, router_id="router-a", **sections)
    standby = await start_router(
        engines, router_id="router-b", router_kwargs={"standby": True}, **sections
    )
    async with http.post(active.url + "/admin/engines", json=_spec("d1", sims[2], "decode")) as r:
        assert r.status == 201, await r.text()
    await _in_service(http, active, "d1")
    async with http.delete(active.url + "/admin/engines/d0") as resp:
        assert resp.status == 200, await resp.text()

    async def followed() -> bool:
        return set(await _engines(http, standby)) == {"p0", "d1"}

    await eventually(followed, timeout_s=10, what="the standby following the membership")
    entry = next(e for e in active.router.handoff.last_document["engine_set"] if e["id"] == "d1")
    assert entry == {
        "id": "d1",
        "url": sims[2].url,
        "role": "decode",
        "origin": "operator",
        "model": "demo-model",
    }

    await active.stop()

    async def serving() -> bool:
        async with http.get(standby.url + "/ready") as resp:
            return resp.status == 200

    await eventually(serving, timeout_s=10, what="the standby serving")
    sims[2].clear_requests()
    body = {"model": "demo-model", "prompt": "after takeover", "max_tokens": 4}
    async with http.post(standby.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    assert [r for r in sims[2].requests() if r["path"] == "/v1/completions"]
