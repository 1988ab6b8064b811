"""Config reload without a restart (DESIGN §10, issue 19): `POST /admin/reload`, `narwhal
reload` and SIGHUP re-read the YAML file, validate it whole, apply the engine set as
membership changes and new timeouts to new requests, and report the keys that need a restart.
A file that does not validate changes nothing, and the answer names the key. With
`controller.config_watch_interval_s`, a file swapped the way kubelet updates a ConfigMap
mount is reloaded by itself."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.support.cli import narwhal
from tests.support.http import metric
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter, router_config
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def sims() -> Iterator[list[SimProcess]]:
    """p0, d0 and d1 (slow: 20 ms a token)."""
    factory = SimFactory()
    p = ["--role", "prefill", "--kv-role", "kv_producer"]
    d = ["--role", "decode", "--kv-role", "kv_consumer"]
    try:
        yield factory.start_many([p, d, [*d, "--itl-ms", "20"]])
    finally:
        factory.close()


def _engines(sims: list[SimProcess], *names: str) -> list[dict[str, Any]]:
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode"}
    index = {"p0": 0, "d0": 1, "d1": 2}
    return [{"id": n, "url": sims[index[n]].url, "role": roles[n]} for n in names]


def _write(path: Path, config: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(config))


async def _router(
    start_router: StartRouter, sims: list[SimProcess], tmp_path: Path
) -> tuple[RunningRouter, Path, dict[str, Any]]:
    """A router started from a file (so that it can re-read it) with p0 and d0."""
    sections: dict[str, Any] = {"controller": {"monitor_interval_s": 0.1}}
    config = router_config(_engines(sims, "p0", "d0"), tmp_path, **sections)
    path = tmp_path / "narwhal.yaml"
    _write(path, config)
    rr = await start_router(config["engines"], router_kwargs={"config_path": path}, **sections)
    # The file says what the router runs: the test fixture chose its `serving.workers`.
    config["serving"] = {**config["serving"], "workers": rr.router.config.serving.workers}
    _write(path, config)
    return rr, path, config


async def _members(http: aiohttp.ClientSession, rr: RunningRouter) -> dict[str, Any]:
    async with http.get(rr.url + "/admin/engines") as resp:
        return {e["id"]: e for e in (await resp.json())["engines"]}


async def _reload(http: aiohttp.ClientSession, rr: RunningRouter) -> tuple[int, Any]:
    async with http.post(rr.url + "/admin/reload") as resp:
        return resp.status, await resp.json()


async def test_a_reload_applies_engines_and_timeouts_and_reports_what_needs_a_restart(
    sims: list[SimProcess],
    start_router: StartRouter,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    rr, path, config = await _router(start_router, sims, tmp_path)
    config["engines"] = _engines(sims, "p0", "d1")
    config["serving"] = {**config["serving"], "request_timeout_s": 1, "stream_idle_timeout_s": 1}
    config["serving"]["first_token_timeout_s"] = 1
    config["serving"]["max_connections"] = 77
    config["router_id"] = "renamed"
    _write(path, config)

    status, answer = await _reload(http, rr)
    assert status == 200, answer
    assert answer["engines"] == {
        "added": ["d1"],
        "removed": ["d0"],
        "relocated": [],
        "replaced": [],
    }
    assert {"engines", "serving.request_timeout_s", "serving.first_token_timeout_s"} <= set(
        answer["applied"]
    )
    assert set(answer["restart_required"]) == {"router_id", "serving.max_connections"}

    async def changed() -> bool:
        members = await _members(http, rr)
        return set(members) == {"p0", "d1"} and members["d1"]["eligible"]

    await eventually(changed, timeout_s=10, what="d1 in, d0 out")
    # The new request deadline (1 s) applies in every data plane: 100 tokens at 20 ms each
    # would take 2 s, so the stream ends with the deadline's error event.
    body = {"model": "demo-model", "prompt": "slow", "max_tokens": 100, "stream": True}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        raw = await resp.read()
    assert b"request deadline exceeded" in raw and b"[DONE]" not in raw
    assert await metric(http, rr.url, "narwhal_reloads_total", result="ok") == 1
    assert await metric(http, rr.url, "narwhal_membership_changes_total", source="reload") >= 2


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda c: c["serving"].update(request_timeout_s=-1), "serving.request_timeout_s"),
        (lambda c: c.update(engines=[]), "engines"),
        (lambda c: c["engines"][1].update(url=c["engines"][0]["url"]), "engines[1].url"),
        (lambda c: c.update(surprise=1), "surprise"),
    ],
)
async def test_a_file_that_does_not_validate_changes_nothing_and_the_answer_names_the_key(
    edit: Any,
    key: str,
    sims: list[SimProcess],
    start_router: StartRouter,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    rr, path, config = await _router(start_router, sims, tmp_path)
    config["engines"].append(_engines(sims, "d1")[0])  # would be added, were the file valid
    edit(config)
    _write(path, config)
    status, answer = await _reload(http, rr)
    assert status == 400, answer
    assert answer["error"]["param"] == key
    assert answer["error"]["message"].startswith("reload refused, nothing changed: ")
    assert set(await _members(http, rr)) == {"p0", "d0"}
    assert await metric(http, rr.url, "narwhal_reloads_total", result="refused") == 1


async def test_a_file_that_is_not_yaml_is_refused(
    sims: list[SimProcess], start_router: StartRouter, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    rr, path, _ = await _router(start_router, sims, tmp_path)
    path.write_text("engines: [\n")
    status, answer = await _reload(http, rr)
    assert status == 400 and "not valid YAML" in answer["error"]["message"]
    assert set(await _members(http, rr)) == {"p0", "d0"}


async def test_sighup_and_the_cli_reload_the_file(
    sims: list[SimProcess], start_router: StartRouter, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    rr, path, config = await _router(start_router, sims, tmp_path)
    config["engines"] = _engines(sims, "p0", "d0", "d1")
    _write(path, config)
    os.kill(os.getpid(), signal.SIGHUP)  # this process runs the router's loop

    async def added() -> bool:
        return "d1" in await _members(http, rr)

    await eventually(added, timeout_s=5, what="d1 added by SIGHUP")

    config["engines"] = _engines(sims, "p0", "d1")
    config["serving"] = {**config["serving"], "max_attempts": 3}
    _write(path, config)
    cli = await narwhal("reload", "--url", rr.url)
    assert cli.code == 0, cli.err
    assert cli.out.splitlines() == [
        "reloaded",
        "applied: engines, serving.max_attempts",
        "engines: removed d0",
    ]


def _kubelet_update(root: Path, version: str, config: dict[str, Any]) -> Path:
    """Publish `config` as kubelet updates a ConfigMap volume: the file in a fresh directory,
    the `..data` symlink swapped to it by a rename, the old directory removed. The router's
    path, `root/narwhal.yaml -> ..data/narwhal.yaml`, never changes."""
    fresh = root / f"..{version}"
    fresh.mkdir()
    _write(fresh / "narwhal.yaml", config)
    data = root / "..data"
    old = data.resolve() if data.is_symlink() else None
    (root / "..data_tmp").symlink_to(fresh.name)
    os.replace(root / "..data_tmp", data)
    path = root / "narwhal.yaml"
    if not path.is_symlink():
        path.symlink_to("..data/narwhal.yaml")
    if old is not None:
        for child in old.iterdir():
            child.unlink()
        old.rmdir()
    return path


async def test_a_watched_configmap_mount_is_reloaded_in_place_when_kubelet_swaps_it(
    sims: list[SimProcess], start_router: StartRouter, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """`controller.config_watch_interval_s`: no SIGHUP, no admin call, no restart; a new
    engine joins, a bad file is refused and changes nothing, a removed engine leaves."""
    sections: dict[str, Any] = {
        "controller": {"monitor_interval_s": 0.1, "config_watch_interval_s": 0.1}
    }
    config = router_config(_engines(sims, "p0", "d0"), tmp_path, **sections)
    mount = tmp_path / "etc-narwhal"
    mount.mkdir()
    path = _kubelet_update(mount, "v1", config)
    rr = await start_router(config["engines"], router_kwargs={"config_path": path}, **sections)
    config["serving"] = {**config["serving"], "workers": rr.router.config.serving.workers}
    config["controller"] = rr.router.config.controller.model_dump()

    # A new engine: joins, verified, in service.
    config["engines"] = _engines(sims, "p0", "d0", "d1")
    _kubelet_update(mount, "v2", config)

    async def d1_in_service() -> bool:
        members = await _members(http, rr)
        return "d1" in members and members["d1"]["eligible"]

    await eventually(d1_in_service, timeout_s=10, what="d1 added by the watched file")
    assert await metric(http, rr.url, "narwhal_reloads_total", result="ok") == 1

    # A file that does not validate: refused, nothing changes, and it is not retried.
    bad = {**config, "serving": {**config["serving"], "request_timeout_s": -1}}
    _kubelet_update(mount, "v3", bad)

    async def refused() -> float:
        return await metric(http, rr.url, "narwhal_reloads_total", result="refused")

    await eventually(refused, timeout_s=10, what="the bad file refused")
    assert set(await _members(http, rr)) == {"p0", "d0", "d1"}

    # Fixed, without d0: d0 drained and forgotten.
    config["engines"] = _engines(sims, "p0", "d1")
    _kubelet_update(mount, "v4", config)

    async def d0_gone() -> bool:
        return set(await _members(http, rr)) == {"p0", "d1"}

    await eventually(d0_gone, timeout_s=10, what="d0 removed by the watched file")
    assert await metric(http, rr.url, "narwhal_reloads_total", result="ok") == 2
    assert await metric(http, rr.url, "narwhal_reloads_total", result="refused") == 1
    assert not rr.task.done()  # the same router all along
    body = {"model": "demo-model", "prompt": "reloaded in place", "max_tokens": 4}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
