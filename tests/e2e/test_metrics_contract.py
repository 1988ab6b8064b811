"""`/metrics` against its documented contract (docs/metrics.md, DESIGN §6).

One running router over real sims exercises every documented metric: successful, failed and
bad requests (stream and not), a retry and a migration under the `bounded` policy, token
checks, an ejected
engine on a closed port (with its failing readmission attempts), an operator drain, a monitor
stage that raises once, handoff writes, a file lease, a refused `--resume`, and a drift
decision. The scrape is parsed with `prometheus_client`'s own parser, and every row of the
docs' table must be there with its type, help text and exactly its documented labels.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from narwhal.control.monitor import STAGE_ORDER
from narwhal.engine.failures import FailureClass
from narwhal.fleet.holds import HoldName
from narwhal.fleet.intervals import Window
from tests.support.poll import eventually
from tests.support.ports import closed_ports
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
KEY = {"Authorization": "Bearer sk-contract"}
PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]


# --------------------------------------------------------------------------- the documented table
def documented() -> dict[str, dict[str, Any]]:
    """docs/metrics.md's table: name -> {type, labels, help}."""
    rows: dict[str, dict[str, Any]] = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `narwhal_"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, kind, labels, meaning = cells[0].strip("`"), cells[1], cells[2], cells[3]
        rows[name] = {
            "type": kind,
            "labels": frozenset()
            if labels in ("—", "-", "")
            else frozenset(x.strip() for x in labels.split(",")),
            "help": meaning,
        }
    return rows


def documented_outcomes() -> set[str]:
    text = " ".join(DOC.read_text().split())
    match = re.search(r"`outcome` is one of (.*?); `failure_class`", text)
    assert match, "the outcome label values are documented"
    return set(re.findall(r"`([a-z_]+)`", match[1]))


def test_the_documented_table_parses() -> None:
    rows = documented()
    assert len(rows) >= 30
    assert rows["narwhal_requests_total"]["labels"] == {"endpoint", "outcome"}
    assert rows["narwhal_pool_waiting"]["labels"] == frozenset()
    assert {r["type"] for r in rows.values()} <= {"counter", "gauge", "histogram"}
    assert {"ok", "upstream_error", "bad_request"} <= documented_outcomes()


# --------------------------------------------------------------------------- the scenario
class FailOnce:
    """A `drains` stage that raises on its first pass, then delegates to the real one."""

    def __init__(self) -> None:
        self.rr: RunningRouter | None = None
        self.raised = False

    async def __call__(self, now: float) -> None:
        if not self.raised:
            self.raised = True
            raise RuntimeError("drains broke once (test)")
        if self.rr is not None:
            await self.rr.router.small.drains(now)


def synthetic_window(started: float, latencies: dict[str, float]) -> Window:
    w = Window(started=started)
    for engine_id, seconds in latencies.items():
        for _ in range(25):  # above the default drift_min_samples (20)
            w.engine(engine_id).latency.observe(seconds)
    return w


async def scrape(http: aiohttp.ClientSession, rr: RunningRouter) -> dict[str, Metric]:
    async with http.get(rr.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


def family_name(name: str, kind: str) -> str:
    return name.removesuffix("_total") if kind == "counter" else name


def has_sample(families: dict[str, Metric], metric: str, **labels: str) -> bool:
    rows = documented()
    family = families.get(family_name(metric, rows[metric]["type"]))
    if family is None:
        return False
    return any(
        s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())
        for s in family.samples
    )


@pytest.mark.slow
async def test_every_documented_metric_is_exported_with_its_labels(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p0, p1, d0 = sim_factory.start_many([PREFILL, PREFILL, DECODE])
    dead = f"http://127.0.0.1:{closed_ports(1)[0]}"
    drains = FailOnce()
    monkeypatch.setenv("TEST_CONTRACT_KEYS", "sk-contract")  # client keys on: counted per key
    discovered = tmp_path / "engines.yaml"
    discovered.write_text("[]\n")  # discovery rounds, finding nothing
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "p1", "url": p1.url, "role": "prefill"},
            {"id": "p2", "url": dead, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
        ],
        serving={"policy": "bounded", "max_attempts": 2},
        recovery={"eject_after": 3, "liveness_misses": 2},
        controller={"drift_mode": "detect", "interval_s": 600},
        lease={
            "backend": "file",
            "path": str(tmp_path / "state" / "lease.json"),
            "ttl_s": 10,
            "renew_interval_s": 2,
        },
        router_kwargs={"resume": True, "stage_overrides": {"drains": drains}},
        discovery={"file": str(discovered), "interval_s": 0.2},
        auth={"api_keys_env": "TEST_CONTRACT_KEYS"},
        placement={"policy": "prefix"},  # cache-aware placement's families get samples
    )
    drains.rr = rr
    router = rr.router

    # The dead engine is ejected, and readmission tries (and fails) to bring it back.
    await eventually(
        lambda: router.fleet.get("p2").ejected is not None, timeout_s=10, what="p2 ejected"
    )
    await eventually(lambda: "p2" in router.readmission.last_results, what="a readmission try")
    async with http.post(rr.url + "/admin/engines/p2/drain") as resp:
        assert resp.status == 200

    # Requests: ok (plain and streamed), a bad one, and one whose decode fails on both attempts.
    plain = {"model": "demo-model", "prompt": "hello there router", "max_tokens": 3}
    async with http.post(rr.url + "/v1/completions", json=plain, headers=KEY) as resp:
        assert resp.status == 200, await resp.text()
    chat = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "stream to me"}],
        "max_tokens": 4,
        "stream": True,
    }
    async with http.post(rr.url + "/v1/chat/completions", json=chat, headers=KEY) as resp:
        assert resp.status == 200
        assert b"data: [DONE]" in await resp.read()
    async with http.post(rr.url + "/v1/completions", data=b"{not json", headers=KEY) as resp:
        assert resp.status == 400
    d0.add_fault({"kind": "completion_status", "status": 500, "leg": "decode", "count": 2})
    async with http.post(rr.url + "/v1/completions", json=plain, headers=KEY) as resp:
        assert resp.status == 502, await resp.text()
    async with http.post(rr.url + "/v1/completions", json=plain, headers=KEY) as resp:
        assert resp.status == 200, await resp.text()
    # A stream whose decode reports an error in band after two tokens: migrated, and saved.
    d0.add_fault({"kind": "error_event", "leg": "decode", "count": 1, "after_tokens": 2})
    streamed = {**plain, "max_tokens": 5, "stream": True}
    async with http.post(rr.url + "/v1/completions", json=streamed, headers=KEY) as resp:
        assert resp.status == 200
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")

    # A request refused at the edge (counted by reason): bytes that are not HTTP.
    host, port = rr.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"NOT HTTP\r\n\r\n")
    async with asyncio.timeout(5):
        assert (await reader.read(65536)).startswith(b"HTTP/1.1 400")
    writer.close()

    # Membership: an engine added at runtime; a reload refused (not started from a file).
    added = {"id": "p3", "url": f"http://127.0.0.1:{closed_ports(1)[0]}", "role": "prefill"}
    async with http.post(rr.url + "/admin/engines", json=added) as resp:
        assert resp.status == 201, await resp.text()
    async with http.post(rr.url + "/admin/reload") as resp:
        assert resp.status == 400

    # A drift decision (detect mode): two closed windows where p1 is 10x its peers. Windows
    # are injected because a real slow engine is the subject of test_controller_drift.py.
    for i in (1, 2):
        router.stats.closed.append(
            synthetic_window(router.clock.monotonic() + i, {"p0": 0.01, "p1": 0.1, "p2": 0.01})
        )

    async def complete() -> dict[str, Metric] | None:
        families = await scrape(http, rr)
        wanted = [
            ("narwhal_monitor_stage_errors_total", {"stage": "drains"}),
            ("narwhal_performance_drift_detected_total", {"engine": "p1"}),
            ("narwhal_readmissions_total", {"engine": "p2"}),
            ("narwhal_holds_active", {"engine": "p2", "hold": "operator_drain"}),
            ("narwhal_handoff_writes_total", {"result": "ok"}),
            ("narwhal_migrated_streams_total", {"result": "saved"}),
            ("narwhal_discovery_rounds_total", {"source": "file", "result": "ok"}),
        ]
        return families if all(has_sample(families, m, **lb) for m, lb in wanted) else None

    families = await eventually(complete, timeout_s=10, what="every scenario metric")
    rows = documented()
    problems: list[str] = []
    for name, row in rows.items():
        family = families.get(family_name(name, row["type"]))
        if family is None:
            problems.append(f"{name}: missing")
            continue
        if family.type != row["type"]:
            problems.append(f"{name}: type {family.type}, documented {row['type']}")
        if family.documentation != row["help"]:
            problems.append(f"{name}: help {family.documentation!r}, documented {row['help']!r}")
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        if not samples:
            problems.append(f"{name}: no samples after the scenario")
        for s in samples:
            labels = set(s.labels) - ({"le"} if s.name.endswith("_bucket") else set())
            if labels != row["labels"]:
                problems.append(f"{s.name}: labels {sorted(labels)}, documented {row['labels']}")
                break
        if row["type"] == "histogram":
            suffixes = {s.name.removeprefix(name) for s in samples}
            if not {"_bucket", "_sum", "_count"} <= suffixes:
                problems.append(f"{name}: histogram samples {sorted(suffixes)}")
    assert problems == []

    # Label values are the documented ones.
    def values(metric: str, label: str) -> set[str]:
        family = families[family_name(metric, rows[metric]["type"])]
        return {s.labels[label] for s in family.samples if label in s.labels}

    outcomes = values("narwhal_requests_total", "outcome")
    assert {"ok", "bad_request", "upstream_error"} <= outcomes
    assert outcomes <= documented_outcomes()
    classes = {c.value for c in FailureClass}
    assert values("narwhal_engine_failures_total", "failure_class") <= classes
    assert values("narwhal_evidence_streak", "failure_class") <= classes
    assert values("narwhal_holds_active", "hold") == {h.value for h in HoldName}
    assert values("narwhal_monitor_stage_seconds", "stage") == set(STAGE_ORDER)
    assert values("narwhal_monitor_stage_errors_total", "stage") <= set(STAGE_ORDER)
    assert values("narwhal_monitor_stage_errors_total", "exception") == {"RuntimeError"}

    # The scenario shows up where it should.
    assert has_sample(families, "narwhal_requests_total", endpoint="chat", outcome="ok")
    assert has_sample(families, "narwhal_retries_total")
    assert has_sample(families, "narwhal_ejections_total", engine="p2")
    assert has_sample(families, "narwhal_engine_ejected", engine="p2")
    assert has_sample(families, "narwhal_readmissions_total", engine="p2", result="failed")
    assert has_sample(families, "narwhal_handoff_resume_total", result="refused")
    assert has_sample(families, "narwhal_lease_role", role="active")
    assert has_sample(families, "narwhal_token_checks_total")
    assert has_sample(families, "narwhal_engine_failures_total", engine="d0")
    assert has_sample(families, "narwhal_pool_connections_limit", pool="control")


async def test_metrics_parse_on_a_fresh_router(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Before any traffic: every documented family is declared with its type."""
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
        ]
    )
    families = await scrape(http, rr)
    for name, row in documented().items():
        family = families.get(family_name(name, row["type"]))
        assert family is not None, name
        assert family.type == row["type"], name


@pytest.mark.slow
async def test_queue_depth_counts_requests_waiting_for_a_data_connection(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    p0, d0 = sim_factory.start_many([PREFILL, [*DECODE, "--itl-ms", "200"]])
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
        ],
        serving={"policy": "bounded", "max_connections": 1, "queue_limit": 8},
    )
    body = {"model": "demo-model", "prompt": "wait your turn", "max_tokens": 5}

    async def one() -> int:
        async with http.post(rr.url + "/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status

    tasks = [asyncio.create_task(one()) for _ in range(3)]
    try:
        pool = rr.router.dataplane.pool
        await eventually(lambda: pool.waiting >= 2, timeout_s=5, what="two requests queued")
        families = await scrape(http, rr)
        [sample] = families["narwhal_pool_waiting"].samples
        assert sample.value == pool.waiting
    finally:
        statuses = await asyncio.gather(*tasks)
    assert statuses == [200, 200, 200]
