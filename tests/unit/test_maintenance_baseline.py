"""Planned maintenance's generation baseline survives the handoff (resume and takeover).

Spec "Readmission and drains": planned maintenance adds a newer-process requirement; operator
holds survive router resume and standby takeover. The baseline (the generation running when
maintenance was requested) is kept on the `planned_maintenance` hold as `newer_than`, so a
router that applies the handoff still refuses the same process. A hold written without it
(an older writer) stays valid.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson

from narwhal.clock import FakeClock
from narwhal.config import Config, parse_config
from narwhal.control.lifecycle import Lifecycle
from narwhal.fleet.events import GenerationSeen
from narwhal.fleet.holds import HoldName
from narwhal.fleet.store import Fleet
from narwhal.state.handoff import apply_document, build_document, check_document, load_schema
from tests.support.router import router_config

ENGINES = [
    {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
]
BASELINE = 1_790_000_123.5


def config(tmp_path: Path) -> Config:
    return parse_config(router_config(ENGINES, tmp_path))


def saved_under_maintenance(cfg: Config, clock: FakeClock) -> bytes:
    fleet = Fleet(cfg.engines, clock)
    lifecycle = Lifecycle(fleet)
    # stale: the router saw an older process last
    fleet.apply(GenerationSeen("p0", BASELINE - 50), clock.monotonic())
    lifecycle.hold(
        fleet.get("p0"),
        HoldName.PLANNED_MAINTENANCE,
        f"planned maintenance at generation {BASELINE}",
        clock.monotonic(),
        newer_than=BASELINE,
    )
    doc = build_document(fleet, 1, clock.wall(), "router-a", None, {})
    return orjson.dumps(doc)


def test_the_baseline_is_written_and_restored(tmp_path: Path) -> None:
    cfg, clock = config(tmp_path), FakeClock()
    raw = saved_under_maintenance(cfg, clock)
    (hold,) = orjson.loads(raw)["engines"]["p0"]["holds"]
    assert hold["name"] == "planned_maintenance" and hold["newer_than"] == BASELINE

    verdict = check_document(raw, cfg, load_schema())
    assert verdict.ok and verdict.document is not None, verdict.reason
    fresh = Fleet(cfg.engines, clock)
    apply_document(verdict.document, fresh, clock)
    restored = fresh.get("p0").holds[HoldName.PLANNED_MAINTENANCE]
    assert restored.newer_than == BASELINE
    assert fresh.get("p0").generation == BASELINE - 50


def test_other_holds_carry_no_baseline(tmp_path: Path) -> None:
    cfg, clock = config(tmp_path), FakeClock()
    fleet = Fleet(cfg.engines, clock)
    Lifecycle(fleet).hold(
        fleet.get("d0"), HoldName.OPERATOR_DRAIN, "operator request", clock.monotonic()
    )
    doc = build_document(fleet, 1, clock.wall(), "router-a", None, {})
    assert doc["engines"]["d0"]["holds"] == [
        {"name": "operator_drain", "reason": "operator request", "since": clock.wall(),
         "deadline": None}
    ]  # fmt: skip


def test_a_hold_without_a_baseline_from_an_older_writer_is_still_applied(tmp_path: Path) -> None:
    cfg, clock = config(tmp_path), FakeClock()
    doc = orjson.loads(saved_under_maintenance(cfg, clock))
    del doc["engines"]["p0"]["holds"][0]["newer_than"]
    del doc["checksum"]
    verdict = check_document(orjson.dumps(resealed(doc)), cfg, load_schema())
    assert verdict.ok and verdict.document is not None, verdict.reason
    fresh = Fleet(cfg.engines, clock)
    apply_document(verdict.document, fresh, clock)
    assert fresh.get("p0").holds[HoldName.PLANNED_MAINTENANCE].newer_than is None


def test_a_baseline_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    cfg, clock = config(tmp_path), FakeClock()
    doc = orjson.loads(saved_under_maintenance(cfg, clock))
    doc["engines"]["p0"]["holds"][0]["newer_than"] = "yesterday"
    del doc["checksum"]
    verdict = check_document(orjson.dumps(resealed(doc)), cfg, load_schema())
    assert not verdict.ok and "newer_than" in verdict.reason, verdict.reason


def resealed(doc: dict[str, object]) -> dict[str, object]:
    """Re-seal an edited document with the writer's checksum."""
    body = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
    return {**doc, "checksum": "sha256:" + hashlib.sha256(body).hexdigest()}
