"""The `handoff` monitor stage in a running router (spec "Durable control-plane state",
"Atomic handoff writes", "Monitoring and readiness"; DESIGN §3-4).

A real router on a loopback socket in front of real `narwhal-sim` processes writes the
handoff on every monitor pass. A failing write, injected through the `Filesystem` seam
(ENOSPC), is a `handoff` stage error: the previous document stays intact, no temporary file
is left, readiness degrades after `controller.monitor_failure_limit` passes with
`monitoring degraded: handoff OSError`, and clearing the fault recovers.

The last test measures the stage's cost for a 64-engine fleet (no assertion on time; the
figure is in docs/handoff.md).
"""

from __future__ import annotations

import errno
import json
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import orjson
import pytest

from narwhal.config import parse_config
from narwhal.fleet.events import GenerationSeen
from narwhal.fleet.holds import HoldName
from narwhal.server import Router
from narwhal.state.atomic import Filesystem
from narwhal.state.handoff import load_schema
from tests.support.poll import eventually
from tests.support.ports import closed_ports
from tests.support.router import StartRouter, router_config
from tests.support.sim_process import SimFactory

SCHEMA_JSON = load_schema()
LIMIT = 3


class FaultyFilesystem(Filesystem):
    """The real file system until `fault` is set; then every write raises it."""

    def __init__(self) -> None:
        self.fault: OSError | None = None
        self.temps: list[Path] = []

    def open_exclusive(self, path: Path, mode: int) -> int:
        self.temps.append(path)
        return super().open_exclusive(path, mode)

    def write(self, fd: int, data: memoryview) -> int:
        if self.fault is not None:
            raise self.fault
        return super().write(fd, data)


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.text()


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def file_size(path: Path) -> int:
    return path.stat().st_size


def read_doc(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_bytes())
    jsonschema.Draft202012Validator(SCHEMA_JSON).validate(doc)
    return doc


@pytest.fixture
def engines(sim_factory: SimFactory) -> list[dict[str, Any]]:
    prefill, decode = sim_factory.start_many(
        [["--role", "prefill", "--kv-role", "kv_producer", "--itl-ms", "0"],
         ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "0"]]
    )  # fmt: skip
    return [
        {"id": "p0", "url": prefill.url, "role": "prefill"},
        {"id": "d0", "url": decode.url, "role": "decode"},
    ]


async def test_every_pass_writes_a_valid_document_with_an_increasing_sequence(
    engines: list[dict[str, Any]], start_router: StartRouter
) -> None:
    rr = await start_router(engines)
    router = rr.router
    path = router.handoff.path
    sequences: list[int] = []

    async def three_more() -> bool:
        if path.exists():
            doc = read_doc(path)
            if not sequences or doc["sequence"] != sequences[-1]:
                sequences.append(doc["sequence"])
            # every pass wrote once: passes and writes move together
            assert router.handoff.writes == router.monitor.status.passes
        return len(sequences) >= 4

    await eventually(three_more, what="four successive handoff documents")
    assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
    doc = read_doc(path)
    assert doc["writer"]["router_id"] == "test-router"
    assert [e["id"] for e in doc["engine_set"]] == ["p0", "d0"]
    assert (path.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["handoff.json"]
    admin = await get_json(rr.url + "/admin/handoff")
    assert admin["path"] == str(path)
    assert admin["document"]["sequence"] >= doc["sequence"] - 1  # (same: rename, then accept)
    metrics = (await get(rr.url + "/metrics"))[1]
    # (the file is renamed into place in a worker thread, just before the count moves)
    assert metric(metrics, 'narwhal_handoff_writes_total{result="ok"}') >= len(sequences) - 1


async def test_the_document_follows_operator_actions_within_a_pass(
    engines: list[dict[str, Any]], start_router: StartRouter
) -> None:
    rr = await start_router(engines)
    async with aiohttp.ClientSession() as s, s.post(rr.url + "/admin/engines/d0/drain") as r:
        assert r.status == 200
    path = rr.router.handoff.path

    def drained() -> bool:
        holds = read_doc(path)["engines"]["d0"]["holds"] if path.exists() else []
        return any(h["name"] == "operator_drain" for h in holds)

    await eventually(drained, timeout_s=5, what="the drain in the handoff")


async def test_a_failing_write_is_a_handoff_stage_error_and_degrades_then_recovers(
    engines: list[dict[str, Any]], start_router: StartRouter
) -> None:
    fs = FaultyFilesystem()
    rr = await start_router(
        engines, router_kwargs={"filesystem": fs}, controller={"monitor_failure_limit": LIMIT}
    )
    router = rr.router
    path = router.handoff.path
    await eventually(lambda: path.exists() and router.monitor.status.passes >= 2)
    assert (await get(rr.url + "/ready")) == (200, "ready")

    fs.fault = OSError(errno.ENOSPC, "No space left on device")
    await eventually(lambda: router.monitor.status.streak >= 1, what="a failing pass")
    previous = path.read_bytes()
    saved = json.loads(previous)
    # failed attempts consume sequence numbers too (a number that may be on disk is never reused)
    assert saved["sequence"] <= router.handoff.sequence

    async def degraded() -> bool:
        return (await get(rr.url + "/ready")) == (503, "monitoring degraded: handoff OSError")

    await eventually(degraded, what="readiness degraded by the handoff stage")
    assert router.monitor.status.streak >= LIMIT
    monitor = await get_json(rr.url + "/admin/monitor")
    assert monitor["degraded"] == "monitoring degraded: handoff OSError"
    assert monitor["admitting"] is False
    last = monitor["last_passes"][0]
    failed = [s for s in last["stages"] if not s["ok"]]
    assert [(s["stage"], s["error"]) for s in failed] == [("handoff", "OSError")]
    assert "No space left on device" in failed[0]["detail"]
    # the other stages still ran in the failing pass
    assert [s["stage"] for s in last["stages"]][-1] == "handoff"
    assert len(last["stages"]) == 8
    # new requests are refused while degraded
    body = {"model": "demo-model", "prompt": "hello there", "max_tokens": 3}
    async with aiohttp.ClientSession() as s, s.post(rr.url + "/v1/completions", json=body) as r:
        assert r.status == 503
    # the previous document is intact and nothing is left behind
    assert path.read_bytes() == previous
    assert sorted(p.name for p in path.parent.iterdir()) == ["handoff.json"]
    assert len(fs.temps) > router.handoff.writes  # failing writes did create temp files
    metrics = (await get(rr.url + "/metrics"))[1]
    assert metric(metrics, 'narwhal_handoff_writes_total{result="failed"}') >= LIMIT
    sample = 'narwhal_monitor_stage_errors_total{exception="OSError",stage="handoff"}'
    assert metric(metrics, sample) >= LIMIT
    assert metric(metrics, "narwhal_monitor_failure_streak") >= LIMIT

    fs.fault = None

    async def recovered() -> bool:
        return (await get(rr.url + "/ready")) == (200, "ready")

    await eventually(recovered, what="readiness after the fault cleared")
    assert router.monitor.status.streak == 0
    doc = read_doc(path)
    assert doc["sequence"] > saved["sequence"]
    # every attempt, failed or not, consumed a number: never fewer numbers than writes
    assert router.handoff.sequence >= router.handoff.writes
    async with aiohttp.ClientSession() as s, s.post(rr.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()


class DirFsyncFails(Filesystem):
    """The directory fsync (after the rename) always fails; everything else is real."""

    def fsync_dir(self, path: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("lease_backend", ["none", "file"])
async def test_a_directory_fsync_failure_after_the_rename_is_counted_not_failed(
    engines: list[dict[str, Any]], start_router: StartRouter, tmp_path: Path, lease_backend: str
) -> None:
    """The document is in place, so the write is accepted: the sequence advances, the monitor
    is not degraded, and the metric counts what may not survive a crash. With a file lease
    the store writes the handoff (under its lock), and its lease record too."""
    lease: dict[str, Any] = {"backend": "none"}
    if lease_backend == "file":
        lease = {"backend": "file", "path": str(tmp_path / "state" / "lease.json"),
                 "ttl_s": 10.0, "renew_interval_s": 1.0}  # fmt: skip
    rr = await start_router(
        engines,
        router_kwargs={"filesystem": DirFsyncFails()},
        controller={"monitor_failure_limit": 1},
        lease=lease,
    )
    router = rr.router
    path = router.handoff.path
    await eventually(lambda: router.handoff.writes >= 3, what="three accepted writes")
    assert read_doc(path)["sequence"] >= 3
    assert router.monitor.status.streak == 0
    assert (await get(rr.url + "/ready")) == (200, "ready")
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    metrics = (await get(rr.url + "/metrics"))[1]
    assert metric(metrics, "narwhal_handoff_dir_fsync_failures_total") >= 3
    assert metric(metrics, 'narwhal_handoff_writes_total{result="failed"}') == 0
    assert metric(metrics, 'narwhal_handoff_writes_total{result="ok"}') >= 3


async def test_a_removed_state_directory_is_a_handoff_stage_error(
    engines: list[dict[str, Any]], start_router: StartRouter
) -> None:
    rr = await start_router(engines)
    path = rr.router.handoff.path
    await eventually(path.exists, what="a first document")
    path.unlink()
    path.parent.rmdir()

    async def degraded() -> bool:
        return (await get(rr.url + "/ready")) == (
            503,
            "monitoring degraded: handoff FileNotFoundError",
        )

    await eventually(degraded, what="readiness degraded by the missing directory")
    assert not path.parent.exists()  # the writer does not recreate it behind the operator
    path.parent.mkdir()

    async def recovered() -> bool:
        return (await get(rr.url + "/ready")) == (200, "ready")

    await eventually(recovered, what="recovery once the directory is back")
    read_doc(path)


async def test_a_state_directory_replaced_by_a_file_is_a_handoff_stage_error(
    engines: list[dict[str, Any]], start_router: StartRouter
) -> None:
    rr = await start_router(engines)
    path = rr.router.handoff.path
    await eventually(path.exists, what="a first document")
    path.unlink()
    path.parent.rmdir()
    path.parent.write_bytes(b"not a directory")
    seen: list[tuple[int, str]] = []

    async def degraded() -> bool:
        seen.append(await get(rr.url + "/ready"))
        status, text = seen[-1]
        return status == 503 and text.startswith("monitoring degraded: handoff ")

    await eventually(degraded, what="readiness degraded by the replaced directory")
    assert seen[-1] == (503, "monitoring degraded: handoff NotADirectoryError")
    assert path.parent.read_bytes() == b"not a directory"  # left for the operator to fix
    path.parent.unlink()
    path.parent.mkdir()

    async def recovered() -> bool:
        return (await get(rr.url + "/ready")) == (200, "ready")

    await eventually(recovered, what="recovery once the directory is back")
    read_doc(path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


async def test_admin_handoff_shows_a_followed_document_newer_than_its_own_write(
    engines: list[dict[str, Any]], start_router: StartRouter, tmp_path: Path
) -> None:
    """A fenced ex-active has its own old write and a followed one from a newer epoch:
    GET /admin/handoff returns the newer by (lease epoch, sequence), not its own."""
    lease = {"backend": "file", "path": str(tmp_path / "state" / "lease.json"),
             "ttl_s": 10.0, "renew_interval_s": 1.0}  # fmt: skip
    rr = await start_router(engines, lease=lease)
    router = rr.router
    await eventually(lambda: router.handoff.writes >= 1, what="a first write")
    assert router.ownership is not None
    own = router.handoff.last_document
    assert own is not None
    epoch = own["writer"]["lease_epoch"]
    newer = {**own, "sequence": 1, "writer": {**own["writer"], "router_id": "router-b",
                                              "lease_epoch": epoch + 1}}  # fmt: skip
    older = {**newer, "writer": {**newer["writer"], "lease_epoch": epoch - 1}}
    router.ownership.followed = older
    body = await get_json(rr.url + "/admin/handoff")
    assert body["document"]["writer"]["router_id"] == "test-router"  # own write is newer
    router.ownership.followed = newer
    body = await get_json(rr.url + "/admin/handoff")
    assert body["document"]["writer"] == newer["writer"]


async def test_the_document_records_lease_ownership_and_only_the_active_writes(
    engines: list[dict[str, Any]], start_router: StartRouter, tmp_path: Path
) -> None:
    lease = {"backend": "file", "path": str(tmp_path / "state" / "lease.json"),
             "ttl_s": 10.0, "renew_interval_s": 1.0}  # fmt: skip
    active = await start_router(engines, lease=lease)
    path = active.router.handoff.path
    await eventually(lambda: active.router.handoff.writes >= 2, what="the active's writes")
    doc = read_doc(path)
    epoch = doc["lease"]["epoch"]
    assert doc["lease"] == {"backend": "file", "holder": "test-router", "epoch": epoch}
    assert epoch >= 1 and doc["writer"]["lease_epoch"] == epoch

    standby = await start_router(
        engines,
        lease=lease,
        router_id="router-b",
        standby={"active_url": active.url, "takeover_threshold": 100},
        router_kwargs={"standby": True},
    )
    # Read before the standby's first step: it names the holder from its first answer.
    assert standby.router.ownership is not None
    seen = standby.router.ownership.to_json()
    assert (seen["role"], seen["holder"], seen["epoch"]) == ("standby", "test-router", epoch)
    writes = active.router.handoff.writes
    await eventually(lambda: active.router.handoff.writes >= writes + 3, what="more writes")
    assert standby.router.handoff.writes == 0
    assert read_doc(path)["writer"]["router_id"] == "test-router"


# --------------------------------------------------------------------------- cost
def closed_port_urls(n: int) -> list[str]:
    """Distinct loopback ports nobody listens on."""
    return [f"http://127.0.0.1:{port}" for port in closed_ports(n)]


class NoSync(Filesystem):
    """Everything but the two fsyncs: separates the durability cost from the rest."""

    def fsync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: Path) -> None:
        pass


async def populated_router(config: Any, fs: Filesystem | None) -> Router:
    router = Router(config, filesystem=fs)
    now = router.clock.monotonic()
    for i, engine in enumerate(router.fleet):  # a realistic mix of state
        router.fleet.apply(GenerationSeen(engine.id, 1_800_000_000.0 + i), now)
        if i % 8 == 1:
            router.operator.drain(engine.id)
        elif i % 8 == 2:
            router.lifecycle.eject(engine, "connection", "refused", now)
        elif i % 8 == 3:
            router.lifecycle.hold(engine, HoldName.INFERENCE_VERIFICATION, "stream streak", now)
    await router.small.controller(now)
    return router


async def time_stage(router: Router, passes: int) -> list[float]:
    now = router.clock.monotonic()
    for _ in range(20):  # warm up
        await router.handoff.stage(now)
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        await router.handoff.stage(now)
        times.append(time.perf_counter() - t0)
    return times


async def test_handoff_stage_cost_for_a_64_engine_fleet(tmp_path: Path) -> None:
    """Measures, never asserts, time. To see the figures (docs/handoff.md):
    .venv/bin/pytest tests/e2e/test_handoff_router.py -k cost -s -q"""
    urls = closed_port_urls(64)
    engines = [
        {"id": f"{'p' if i < 32 else 'd'}{i:02d}", "url": u,
         "role": "prefill" if i < 32 else "decode"}
        for i, u in enumerate(urls)
    ]  # fmt: skip
    config = parse_config(router_config(engines, tmp_path, recovery={"failure_quarantine_s": 60}))
    path = Path(config.handoff.path)
    path.parent.mkdir(parents=True)
    passes = 300
    router = await populated_router(config, None)
    durable = await time_stage(router, passes)
    doc = read_doc(path)
    assert len(doc["engines"]) == 64
    size = file_size(path)
    no_fsync = await time_stage(await populated_router(config, NoSync()), passes)
    build = []
    for _ in range(passes):
        t0 = time.perf_counter()
        orjson.dumps(router.handoff.document(), option=orjson.OPT_INDENT_2)
        build.append(time.perf_counter() - t0)

    def summary(xs: list[float]) -> str:
        p99 = statistics.quantiles(xs, n=100)[98]
        return f"median {statistics.median(xs) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"

    print(
        f"\nhandoff stage, 64 engines, {size} bytes, {passes} passes each:"
        f"\n  full stage (atomic write, fsync file + dir): {summary(durable)}"
        f"\n  same without the two fsyncs:                {summary(no_fsync)}"
        f"\n  build + serialise only (no I/O):            {summary(build)}"
    )
