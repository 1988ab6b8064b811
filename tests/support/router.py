"""A Narwhal router running in the test's event loop, on a real loopback socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from narwhal.config import parse_config
from narwhal.process.spawner import WorkerSpawner
from narwhal.server import Router
from tests.support.poll import eventually


@dataclass
class RunningRouter:
    router: Router
    url: str
    task: asyncio.Task[None]

    async def ready(self, timeout_s: float = 10.0) -> None:
        """Until `/ready` answers 200. `start_router` returns once the start-up sweep ended,
        whose health checks may outlast `engine.health_timeout_s` (0.5 s here) on a loaded
        host: those engines are verified by the monitor's next passes, and until then a
        request may be answered 503 `starting`."""
        async with aiohttp.ClientSession() as http:

            async def ok() -> bool:
                try:
                    async with http.get(self.url + "/ready") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await eventually(ok, timeout_s=timeout_s, what=f"{self.url}/ready 200")

    def holds(self, engine_id: str) -> list[str]:
        """The engine's hold names, as /admin/engines lists them."""
        state = next(e for e in self.router.engines_json() if e["id"] == engine_id)
        return list(state["holds"])

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def router_config(engines: list[dict[str, Any]], tmp_path: Path, **sections: Any) -> dict[str, Any]:
    """A config dict with fast test timings; `sections` override or extend it."""
    config: dict[str, Any] = {
        "router_id": "test-router",
        "listen": "127.0.0.1:0",
        "model": "demo-model",
        "engines": engines,
        "controller": {"monitor_interval_s": 0.1, "monitor_failure_limit": 3},
        "engine": {"health_timeout_s": 0.5, "probe_timeout_s": 2.0},
        "serving": {"request_timeout_s": 10, "first_token_timeout_s": 2,
                    "stream_idle_timeout_s": 1},
        "handoff": {"path": str(tmp_path / "state" / "handoff.json")},
        # The failure model's tests count on least in-flight with ties in rotation (which
        # engine a request goes to); cache-aware placement's tests set `prefix`, the default.
        "placement": {"policy": "least_loaded"},
    }  # fmt: skip
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


StartRouter = Callable[..., Awaitable[RunningRouter]]

# How long `start_router` waits for a router that says `starting` to say anything else.
STARTING_WAIT_S = 5.0


async def _past_starting(rr: RunningRouter) -> None:
    """Until `/ready` says something other than `starting: ...`, for at most
    `STARTING_WAIT_S`, then on regardless. The start-up sweep checks every engine within
    `engine.health_timeout_s` (0.5 s here); on a loaded host a healthy sim can answer later,
    and is verified by the monitor's next pass, a moment after `start_router` returned: a
    test's first request then got 503 `starting` (the loaded CI run of 2026-12-07 23:12). A
    router whose engines cannot be verified (down, the wrong model) still says `starting`
    when the test begins, only later."""
    deadline = asyncio.get_running_loop().time() + STARTING_WAIT_S
    async with aiohttp.ClientSession() as http:
        while asyncio.get_running_loop().time() < deadline:
            try:
                async with http.get(rr.url + "/ready") as resp:
                    if not (await resp.text()).startswith("starting:"):
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.02)


# Data-plane injections that only a single-process router honours (its data plane runs in
# this process): a router built with them runs `serving.workers: 1`.
_IN_PROCESS_ONLY = frozenset({"clock", "new_request_id"})


def _workers_for(
    sections: dict[str, Any], router_kwargs: dict[str, Any], single_process: bool
) -> dict[str, Any]:
    """Routers run the configured default (`auto`: one worker per usable CPU), or
    `NARWHAL_TEST_WORKERS` (a count or `auto`; `make pytest-single` sets 1), unless the test
    chose `serving.workers`. A test that reaches into the router's own data plane (marker
    `single_process`, or a data-plane injection) runs one process."""
    serving = sections.get("serving", {})
    if "workers" in serving:
        return sections
    if single_process or _IN_PROCESS_ONLY & router_kwargs.keys():
        workers: int | str = 1
    else:
        chosen = os.environ.get("NARWHAL_TEST_WORKERS")
        if chosen is None:
            return sections
        workers = chosen if chosen == "auto" else int(chosen)
    if workers != "auto" and "max_connections" in serving:
        workers = min(int(workers), serving["max_connections"])
    return {**sections, "serving": {**serving, "workers": workers}}


@pytest.fixture(scope="session")
def worker_spawner() -> Iterator[WorkerSpawner]:
    """One zygote for the session's worker-mode routers: each forks its workers from it in
    milliseconds instead of starting interpreters that import the worker (0.4 s a router)."""
    spawner = WorkerSpawner()
    yield spawner
    asyncio.run(spawner.aclose())


@pytest.fixture
async def start_router(
    tmp_path: Path, request: pytest.FixtureRequest, worker_spawner: WorkerSpawner
) -> AsyncIterator[StartRouter]:
    """`await start_router(engines, **sections, router_kwargs={...})` -> RunningRouter."""
    running: list[RunningRouter] = []

    async def start(
        engines: list[dict[str, Any]], router_kwargs: dict[str, Any] | None = None, **sections: Any
    ) -> RunningRouter:
        single = request.node.get_closest_marker("single_process") is not None
        sections = _workers_for(sections, router_kwargs or {}, single)
        config = parse_config(router_config(engines, tmp_path, **sections))
        Path(config.handoff.path).parent.mkdir(parents=True, exist_ok=True)
        router = Router(config, **{"spawner": worker_spawner, **(router_kwargs or {})})
        bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(router.run("127.0.0.1", 0, on_ready=bound.set_result))
        async with asyncio.timeout(10):
            done, _ = await asyncio.wait({bound, task}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises the startup error
        rr = RunningRouter(router, f"http://127.0.0.1:{bound.result()}", task)
        running.append(rr)
        if "clock" not in (router_kwargs or {}):  # a fake clock runs no pass by itself
            await _past_starting(rr)
        return rr

    yield start
    for rr in running:
        await rr.stop()
