"""Router resume from a saved handoff (spec "Resume validation", "Durable control-plane
state", "Operator drains survive: router resume", "Restarting the router starts with fresh
monitor-failure counters"; DESIGN §4).

Two routers in turn on the same handoff path, in front of real `narwhal-sim` processes (and
a closed loopback port for the dead engine): the first builds up state, stops; the second
starts with `resume=True`. Applied: drains, quarantines (with their wall deadline) and
ejections are back, the sequence continues, the monitor streak starts at 0. Refused (other
engine set, other schema version, truncated, tampered, missing, unreadable): the reason is
reported (log, metric, admin API), the router starts fresh and serves.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import orjson
import pytest

from narwhal.clock import SystemClock
from narwhal.config import parse_config
from narwhal.fleet.events import HoldRequested
from narwhal.fleet.holds import HoldName
from narwhal.fleet.store import Fleet
from narwhal.state.atomic import Filesystem, host_tag
from narwhal.state.handoff import build_document, load_schema
from tests.support.poll import eventually
from tests.support.ports import closed_ports
from tests.support.router import RunningRouter, StartRouter, router_config
from tests.support.sim_process import SimFactory, SimProcess

SCHEMA_JSON = load_schema()
QUARANTINE_S = 600.0


# --------------------------------------------------------------------------- helpers
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def closed_port_url() -> str:
    return f"http://127.0.0.1:{closed_ports(1)[0]}"


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.text()


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def post(url: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def engines_by_id(rr: RunningRouter) -> dict[str, dict[str, Any]]:
    body = await get_json(rr.url + "/admin/engines")
    return {e["id"]: e for e in body["engines"]}


def metric(text: str, sample: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


async def resume_metrics(rr: RunningRouter) -> tuple[float | None, float | None]:
    text = (await get(rr.url + "/metrics"))[1]
    return (
        metric(text, 'narwhal_handoff_resume_total{result="applied"}'),
        metric(text, 'narwhal_handoff_resume_total{result="refused"}'),
    )


async def refusal_metric(rr: RunningRouter, code: str) -> float | None:
    text = (await get(rr.url + "/metrics"))[1]
    return metric(text, f'narwhal_handoff_resume_refusals_total{{reason="{code}"}}')


def save(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def read_doc(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_bytes())
    jsonschema.Draft202012Validator(SCHEMA_JSON).validate(doc)
    return doc


async def complete(rr: RunningRouter) -> int:
    body = {"model": "demo-model", "prompt": "the quick brown fox", "max_tokens": 4}
    status, _ = await post(rr.url + "/v1/completions", body)
    return status


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, SimProcess]]:
    """Three live engines shared by the module (the routers under test change, not them)."""
    factory = SimFactory()
    try:
        p0, p1, d0 = factory.start_many(
            [["--role", "prefill", "--kv-role", "kv_producer", "--itl-ms", "0"],
             ["--role", "prefill", "--kv-role", "kv_producer", "--itl-ms", "0"],
             ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "0"]]
        )  # fmt: skip
        yield {"p0": p0, "p1": p1, "d0": d0}
    finally:
        factory.close()


@pytest.fixture
def live(sims: dict[str, SimProcess]) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": sims["p0"].url, "role": "prefill"},
        {"id": "p1", "url": sims["p1"].url, "role": "prefill"},
        {"id": "d0", "url": sims["d0"].url, "role": "decode"},
    ]


@pytest.fixture
def with_dead(live: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live engines plus d1, a decode engine on a closed port (it gets ejected)."""
    return [*live, {"id": "d1", "url": closed_port_url(), "role": "decode"}]


class TrackingFilesystem(Filesystem):
    """Counts writes in progress. A stopped router's last write may still be finishing in its
    worker thread; the test waits for it before reading what the next router will read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0

    def open_exclusive(self, path: Path, mode: int) -> int:
        fd = super().open_exclusive(path, mode)
        with self._lock:
            self.in_flight += 1
        return fd

    def unlink(self, path: Path) -> None:
        super().unlink(path)
        with self._lock:
            self.in_flight -= 1

    def fsync_dir(self, path: Path) -> None:
        super().fsync_dir(path)
        with self._lock:
            self.in_flight -= 1


async def first_router_state(
    rr: RunningRouter, fs: TrackingFilesystem, ready: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Wait until the first router's handoff shows the state, stop it, return the file."""
    path = rr.router.handoff.path

    def shows() -> bool:
        return path.exists() and ready(read_doc(path))

    await eventually(shows, what="the state in the first router's handoff")
    await rr.stop()
    await eventually(lambda: fs.in_flight == 0, what="the last write to finish")
    return read_doc(path)


def drained_and_quarantined(doc: dict[str, Any]) -> bool:
    engines = doc["engines"]
    return (
        [h["name"] for h in engines["p1"]["holds"]] == ["operator_drain"]
        and engines["d1"]["ejection"] is not None
        and [h["name"] for h in engines["d1"]["holds"]] == ["failure_quarantine"]
    )


# --------------------------------------------------------------------------- applied
async def test_drain_quarantine_and_ejection_survive_a_restart(
    with_dead: list[dict[str, Any]],
    sims: dict[str, SimProcess],
    start_router: StartRouter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.resume")
    recovery = {"failure_quarantine_s": QUARANTINE_S}
    fs = TrackingFilesystem()
    first = await start_router(with_dead, recovery=recovery, router_kwargs={"filesystem": fs})
    assert (await post(first.url + "/admin/engines/p1/drain"))[0] == 200
    saved = await first_router_state(first, fs, drained_and_quarantined)
    quarantine = saved["engines"]["d1"]["holds"][0]

    second = await start_router(with_dead, recovery=recovery, router_kwargs={"resume": True})
    verdict = second.router.resume_verdict
    assert verdict is not None and verdict.ok
    assert verdict.reason == f"applied handoff sequence {saved['sequence']} from test-router"
    assert f"resume: {verdict.reason}" in caplog.messages
    assert await resume_metrics(second) == (1.0, None)

    async def check(engines: dict[str, dict[str, Any]]) -> None:
        p1, d1 = engines["p1"], engines["d1"]
        assert p1["holds"] == ["operator_drain"]
        assert p1["eligible"] is False and p1["ejected"] is False
        assert d1["ejected"] is True
        assert d1["ejection"] == {**saved["engines"]["d1"]["ejection"], "class": "connection"}
        assert d1["eligible"] is False
        assert d1["holds"] == ["failure_quarantine"]
        (hold,) = d1["hold_details"]
        assert hold == quarantine  # the same wall deadline, not a fresh 600 s
        assert engines["p0"]["eligible"] and engines["d0"]["eligible"]

    await check(await engines_by_id(second))
    # ... and still after several passes: p1's health 200 does not clear the drain, d1's
    # quarantine keeps readmission away.
    passes = second.router.monitor.status.passes
    await eventually(lambda: second.router.monitor.status.passes >= passes + 3)
    await check(await engines_by_id(second))
    assert read_doc(second.router.handoff.path)["engines"]["p1"]["holds"][0]["name"] == (
        "operator_drain"
    )
    # The drained engine gets no new work after the restart.
    sims["p1"].clear_requests()
    sims["p0"].clear_requests()
    assert await complete(second) == 200
    assert sims["p1"].requests() == []
    assert len(sims["p0"].requests()) == 1


async def test_an_ejection_survives_and_the_sequence_continues(
    with_dead: list[dict[str, Any]], start_router: StartRouter
) -> None:
    fs = TrackingFilesystem()
    first = await start_router(with_dead, router_kwargs={"filesystem": fs})
    saved = await first_router_state(
        first, fs, lambda d: d["engines"]["d1"]["ejection"] is not None and d["sequence"] >= 5
    )
    assert saved["engines"]["d1"]["holds"] == []  # no quarantine configured

    second = await start_router(with_dead, router_kwargs={"resume": True})
    router = second.router
    assert router.handoff.sequence >= saved["sequence"]
    d1 = (await engines_by_id(second))["d1"]
    # The admin view is the saved record plus `class` (the failure class that ejected it).
    assert d1["ejected"] is True
    assert d1["ejection"] == {**saved["engines"]["d1"]["ejection"], "class": "connection"}

    def written() -> bool:
        return router.handoff.writes >= 3

    await eventually(written, what="the second router's writes")
    doc = read_doc(router.handoff.path)
    # Monotonic across the restart: the second router's first document was saved + 1.
    # (`accept` sets the last document and the write count together; `sequence` alone may
    # already be one ahead, taken by a write in progress.)
    accepted = router.handoff.last_document
    assert accepted is not None
    assert accepted["sequence"] == saved["sequence"] + router.handoff.writes
    assert doc["sequence"] > saved["sequence"]
    assert doc["engines"]["d1"]["ejection"] == saved["engines"]["d1"]["ejection"]
    # The engine is still dead: readmission keeps failing and it stays ejected.
    assert (await engines_by_id(second))["d1"]["ejected"] is True


async def test_without_resume_nothing_is_applied_but_the_sequence_continues(
    with_dead: list[dict[str, Any]], start_router: StartRouter
) -> None:
    fs = TrackingFilesystem()
    first = await start_router(with_dead, router_kwargs={"filesystem": fs})
    saved = await first_router_state(first, fs, lambda d: d["sequence"] >= 3)

    second = await start_router(with_dead)
    router = second.router
    assert router.resume_verdict is None  # nothing was applied
    assert router.handoff.sequence >= saved["sequence"]
    await eventually(lambda: router.handoff.writes >= 1, what="the second router's first write")
    assert read_doc(router.handoff.path)["sequence"] > saved["sequence"]


async def test_without_resume_a_huge_saved_sequence_is_ignored_not_continued(
    live: list[dict[str, Any]], start_router: StartRouter, tmp_path: Path
) -> None:
    """A sequence beyond JSON-safe integers would make every later write fail to serialise
    (`/ready`: `monitoring degraded: handoff TypeError`); it is ignored instead."""
    path = tmp_path / "state" / "handoff.json"
    save(path, _huge_sequence(live, tmp_path))
    rr = await start_router(live)
    router = rr.router
    await eventually(lambda: router.handoff.writes >= 3, what="three writes after the start")
    assert router.monitor.to_json()["streak"] == 0
    assert (await get(rr.url + "/ready")) == (200, "ready")
    assert 3 <= read_doc(path)["sequence"] <= router.handoff.writes


class BreakableFilesystem(Filesystem):
    def __init__(self) -> None:
        self.broken = False

    def write(self, fd: int, data: memoryview) -> int:
        if self.broken:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(fd, data)


async def test_the_monitor_failure_streak_starts_at_zero_after_resume(
    live: list[dict[str, Any]], start_router: StartRouter
) -> None:
    fs = BreakableFilesystem()
    first = await start_router(live, router_kwargs={"filesystem": fs})
    await eventually(first.router.handoff.path.exists, what="a first document")
    fs.broken = True

    async def degraded() -> bool:
        return (await get(first.url + "/ready"))[0] == 503

    await eventually(degraded, what="the first router degraded")
    assert first.router.monitor.status.streak >= 3
    await first.stop()

    second = await start_router(live, router_kwargs={"resume": True})
    assert second.router.resume_verdict is not None and second.router.resume_verdict.ok
    assert second.router.monitor.status.streak == 0  # fresh, not the saved router's 3+
    assert (await get(second.url + "/ready")) == (200, "ready")
    monitor = await get_json(second.url + "/admin/monitor")
    assert monitor["streak"] == 0 and monitor["degraded"] is None and monitor["admitting"]
    text = (await get(second.url + "/metrics"))[1]
    assert metric(text, "narwhal_monitor_failure_streak") == 0.0


async def test_resume_removes_temporary_files_of_dead_writers(
    live: list[dict[str, Any]], start_router: StartRouter
) -> None:
    fs = TrackingFilesystem()
    first = await start_router(live, router_kwargs={"filesystem": fs})
    path = first.router.handoff.path
    await first_router_state(first, fs, lambda d: True)
    gone = await asyncio.to_thread(dead_pid)
    stale = path.with_name(f".handoff.json.{gone}.{host_tag()}.0badc0de.tmp")
    stale.write_bytes(b'{"partial": ')
    live_tmp = path.with_name(f".handoff.json.{os.getpid()}.{host_tag()}.feedf00d.tmp")
    live_tmp.write_bytes(b'{"in progress": ')

    await start_router(live, router_kwargs={"resume": True})
    assert not stale.exists()
    assert live_tmp.exists()  # a live writer's file is never touched
    live_tmp.unlink()


# --------------------------------------------------------------------------- refused
def offline_document(
    engines: list[dict[str, Any]], tmp_path: Path, sequence: int = 41
) -> dict[str, Any]:
    """A valid document for `engines` in which every engine is drained (visible if applied)."""
    config = parse_config(router_config(engines, tmp_path))
    clock = SystemClock()
    fleet = Fleet(config.engines, clock)
    for engine in fleet:
        fleet.apply(HoldRequested(engine.id, HoldName.OPERATOR_DRAIN, "operator request"), 0.0)
    return build_document(fleet, sequence, clock.wall(), "router-old", None, {})


def reseal(doc: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    digest = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return {**body, "checksum": "sha256:" + digest}


def encode(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


ENGINE_SET_PREFIX = "engine set differs from the config: "


def _added(live: list[dict[str, Any]], tmp: Path) -> bytes:
    return encode(offline_document([e for e in live if e["id"] != "p1"], tmp))


def _removed(live: list[dict[str, Any]], tmp: Path) -> bytes:
    extra = {"id": "d9", "url": closed_port_url(), "role": "decode"}
    return encode(offline_document([*live, extra], tmp))


def _moved(live: list[dict[str, Any]], tmp: Path) -> bytes:
    moved = [e if e["id"] != "p1" else {**e, "url": closed_port_url()} for e in live]
    return encode(offline_document(moved, tmp))


def _schema_v2(live: list[dict[str, Any]], tmp: Path) -> bytes:
    return encode(reseal({**offline_document(live, tmp), "schema": "narwhal.handoff/2"}))


def _truncated(live: list[dict[str, Any]], tmp: Path) -> bytes:
    raw = encode(offline_document(live, tmp))
    return raw[: len(raw) // 2]


def _tampered(live: list[dict[str, Any]], tmp: Path) -> bytes:
    doc = json.loads(encode(offline_document(live, tmp)))
    doc["engines"]["p0"]["holds"][0]["reason"] = "edited by hand"
    return json.dumps(doc, indent=2).encode()


def _huge_sequence(live: list[dict[str, Any]], tmp: Path) -> bytes:
    return encode(reseal({**offline_document(live, tmp), "sequence": 2**64 - 1}))


def _two_drains(live: list[dict[str, Any]], tmp: Path) -> bytes:
    doc = offline_document(live, tmp)
    holds = doc["engines"]["p0"]["holds"]
    holds.append(dict(holds[0]))
    return encode(reseal(doc))


REFUSALS = [
    pytest.param(_added, ENGINE_SET_PREFIX + "in config only ['p1'], in handoff only []",
                 "engine_set", id="engine-added"),
    pytest.param(_removed, ENGINE_SET_PREFIX + "in config only [], in handoff only ['d9']",
                 "engine_set", id="engine-removed"),
    pytest.param(_moved, ENGINE_SET_PREFIX + "in config only ['p1'], in handoff only ['p1']",
                 "engine_set", id="url-changed"),
    pytest.param(_schema_v2, "schema 'narwhal.handoff/2' does not match 'narwhal.handoff/1'",
                 "schema_version", id="schema-version"),
    pytest.param(_truncated, "not valid JSON (truncated or corrupt): ", "invalid_json",
                 id="truncated"),
    pytest.param(_tampered, "checksum mismatch: the document was modified after it was written",
                 "checksum", id="tampered"),
    pytest.param(_huge_sequence, "fails the schema at sequence: 18446744073709551615 is "
                 "greater than the maximum of 9007199254740991", "schema", id="huge-sequence"),
    pytest.param(_two_drains, "impossible values: p0 has 2 operator_drain holds", "impossible",
                 id="two-drains"),
    pytest.param(None, "no handoff file", "missing", id="missing"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "expected", "code"), REFUSALS)
async def test_a_mismatched_or_damaged_handoff_is_refused_and_the_router_starts_fresh(
    live: list[dict[str, Any]],
    start_router: StartRouter,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    make: Callable[[list[dict[str, Any]], Path], bytes] | None,
    expected: str,
    code: str,
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.resume")
    path = tmp_path / "state" / "handoff.json"
    path.parent.mkdir()
    refused = make(live, tmp_path) if make is not None else None
    if refused is not None:
        path.write_bytes(refused)

    rr = await start_router(live, router_kwargs={"resume": True})
    verdict = rr.router.resume_verdict
    assert verdict is not None and not verdict.ok
    if expected.endswith(": "):
        assert verdict.reason.startswith(expected)
    else:
        assert verdict.reason == expected
    assert f"resume: starting fresh: {verdict.reason}" in caplog.messages
    assert await resume_metrics(rr) == (None, 1.0)
    assert await refusal_metric(rr, code) == 1.0
    assert (await get_json(rr.url + "/admin/handoff"))["resume"]["code"] == code
    # Fresh: nothing of the refused document was applied, and the router serves.
    engines = await engines_by_id(rr)
    assert all(e["holds"] == [] and e["ejected"] is False for e in engines.values())
    assert all(e["eligible"] for e in engines.values())
    assert (await get(rr.url + "/ready")) == (200, "ready")
    assert await complete(rr) == 200
    # Its own handoff replaces the refused one; the sequence goes on from the refused file's
    # own number when it has one (never backwards), else from the start.
    await eventually(lambda: rr.router.handoff.writes >= 1, what="a fresh document")
    doc = read_doc(path)
    assert doc["writer"]["router_id"] == "test-router"
    # `accept` sets the last document and the write count together; `sequence` alone may
    # already be one ahead (a number is taken when a write starts).
    accepted = rr.router.handoff.last_document
    assert accepted is not None
    assert accepted["sequence"] == _saved_sequence(refused) + rr.router.handoff.writes


def _saved_sequence(raw: bytes | None) -> int:
    try:
        sequence = json.loads(raw or b"")["sequence"]
    except (ValueError, KeyError, TypeError):
        return 0
    in_range = isinstance(sequence, int) and 1 <= sequence <= 2**53 - 1
    return sequence if in_range else 0


@pytest.mark.parametrize("case", ["applied", "refused"])
async def test_the_admin_api_reports_the_resume_decision(
    live: list[dict[str, Any]], start_router: StartRouter, tmp_path: Path, case: str
) -> None:
    path = tmp_path / "state" / "handoff.json"
    path.parent.mkdir()
    doc = offline_document(live, tmp_path)
    path.write_bytes(encode(doc) if case == "applied" else _tampered(live, tmp_path))
    rr = await start_router(live, router_kwargs={"resume": True})
    verdict = rr.router.resume_verdict
    assert verdict is not None
    body = await get_json(rr.url + "/admin/handoff")
    resume = body.get("resume")
    assert isinstance(resume, dict), body
    assert resume.get("applied") is (case == "applied")
    assert resume.get("reason") == verdict.reason


async def test_an_unreadable_handoff_is_refused_not_a_crash(
    live: list[dict[str, Any]], start_router: StartRouter, tmp_path: Path
) -> None:
    path = tmp_path / "state" / "handoff.json"
    path.mkdir(parents=True)
    rr = await start_router(live, router_kwargs={"resume": True})
    verdict = rr.router.resume_verdict
    assert verdict is not None and not verdict.ok
    assert await resume_metrics(rr) == (None, 1.0)
    assert await refusal_metric(rr, "unreadable") == 1.0


async def test_an_inference_verification_hold_is_restored_then_probed_and_cleared(
    live: list[dict[str, Any]], start_router: StartRouter, tmp_path: Path
) -> None:
    config = parse_config(router_config(live, tmp_path))
    clock = SystemClock()
    fleet = Fleet(config.engines, clock)
    reason = "kv_handoff streak: 3 x unreadable"
    fleet.apply(HoldRequested("p0", HoldName.INFERENCE_VERIFICATION, reason), 0.0)
    save(Path(config.handoff.path), encode(build_document(fleet, 9, clock.wall(), "r", None, {})))

    rr = await start_router(live, router_kwargs={"resume": True})
    hold = rr.router.fleet.get("p0").holds[HoldName.INFERENCE_VERIFICATION]
    assert hold.reason == "kv_handoff streak: 3 x unreadable"
    # The resumed monitor probes the engine (a healthy sim) and the probe clears the hold.

    async def cleared() -> bool:
        return (await engines_by_id(rr))["p0"]["holds"] == []

    await eventually(cleared, what="the inference probe to clear the restored hold")
    text = (await get(rr.url + "/metrics"))[1]
    assert (
        metric(text, 'narwhal_probes_total{engine="p0",kind="inference",result="ok"}') or 0
    ) >= 1
