"""The handoff document (spec "Durable control-plane state", "Resume validation"; DESIGN §4).

`build_document` over a fleet with every kind of state, validated against the shipped JSON
Schema; `check_document` refusing each bad input with its exact reason; `apply_document`
restoring roles, ejections, holds (a deadline that passed while the router was down counts
as passed), inference holds, generations, verification (absent: verified) and counters -- and
never monitor-failure counters. Everything runs on a fake clock; the end-to-end restart is in
tests/e2e/test_handoff_resume.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest

from narwhal.clock import FakeClock
from narwhal.config import Config, Role, parse_config
from narwhal.control.evidence import EvidenceRecorder
from narwhal.control.lifecycle import Lifecycle
from narwhal.control.stages import consolidation_risk
from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.fleet.events import GenerationSeen, LivenessSwept, ModelLimitLearned, RoleChanged
from narwhal.fleet.holds import HoldName
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from narwhal.state.atomic import Filesystem
from narwhal.state.handoff import (
    CLOCK_SKEW_ALLOWANCE_S,
    REFUSAL_CODES,
    SCHEMA,
    HandoffWriter,
    apply_document,
    build_document,
    check_document,
    load_schema,
    member_entry,
    members_of,
    newest,
)
from narwhal.telemetry.fleet_metrics import watch_fleet
from narwhal.telemetry.metrics import Metrics
from tests.support.router import router_config

QUARANTINE_S = 120.0
DRIFT_S = 30.0
LEASE = {"backend": "file", "holder": "router-a", "epoch": 4}
ENGINES = [
    {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
    {"id": "p1", "url": "http://127.0.0.1:9002", "role": "prefill"},
    {"id": "p2", "url": "http://127.0.0.1:9003", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
    {"id": "d1", "url": "http://127.0.0.1:9102", "role": "decode"},
    {"id": "d2", "url": "http://127.0.0.1:9103", "role": "decode"},
    {"id": "d3", "url": "http://127.0.0.1:9104", "role": "decode"},
]
SCHEMA_JSON = load_schema()


def make_config(tmp_path: Path, engines: list[dict[str, Any]] | None = None) -> Config:
    return parse_config(
        router_config(
            ENGINES if engines is None else engines,
            tmp_path,
            recovery={"failure_quarantine_s": QUARANTINE_S, "eject_after": 3},
        )
    )


class Rig:
    """A fleet with one engine in each interesting state, on a fake clock."""

    def __init__(self, config: Config, clock: FakeClock | None = None) -> None:
        self.config = config
        self.clock = clock or FakeClock()
        self.metrics = Metrics()
        self.fleet = Fleet(config.engines, self.clock, Policy.of(config.recovery))
        watch_fleet(self.fleet, self.metrics, self.clock)
        self.lifecycle = Lifecycle(self.fleet)
        self.evidence = EvidenceRecorder(self.fleet, self.clock)

    def populate(self) -> None:
        """p0 serves (generation known); p1 drained; p2 under inference verification and
        drifting; d0 under planned maintenance; d1 ejected and quarantined; d2 ejected with
        its quarantine cleared, never verified (it died before its first healthy answer);
        d3 serves after a readmission. Every other engine was verified."""
        now = self.clock.monotonic()
        fl, lc = self.fleet, self.lifecycle
        for engine in fl:
            if engine.id != "d2":
                lc.verify(engine, True, "health 200, serves 'demo-model'", now)
        fl.apply(GenerationSeen("p0", 1_799_990_000.25), now)
        fl.apply(GenerationSeen("d0", 1_799_990_100.5), now)
        lc.hold(fl.get("p1"), HoldName.OPERATOR_DRAIN, "operator request", now)
        lc.hold(fl.get("p2"), HoldName.INFERENCE_VERIFICATION, "stream streak: 3 x stall", now)
        lc.hold(fl.get("p2"), HoldName.PERFORMANCE_DRIFT, "3.1x role median", now, DRIFT_S)
        lc.hold(fl.get("d0"), HoldName.PLANNED_MAINTENANCE, "planned maintenance", now)
        for _ in range(3):
            self.evidence.failure("d1", EngineFailure(FailureClass.CONNECTION, "refused"), "hc")
        lc.eject(fl.get("d1"), "connection", "connection streak: refused", now)
        self.clock.advance(5)
        now = self.clock.monotonic()
        lc.eject(fl.get("d2"), "liveness", "3 silent health sweeps", now)
        lc.release(fl.get("d2"), HoldName.FAILURE_QUARANTINE, "health 200", now)
        lc.eject(fl.get("d3"), "kv_handoff", "probe failed", now)
        lc.readmit(fl.get("d3"), "verified", now)
        self.evidence.failure("p0", EngineFailure(FailureClass.TIMEOUT, "slow"), "prefill")
        for _ in range(2):
            self.fleet.apply(LivenessSwept("p0", silent=True), now)

    def build(self, sequence: int = 7, lease: dict[str, Any] | None = LEASE) -> dict[str, Any]:
        risk = consolidation_risk(self.fleet, self.clock.monotonic())
        return build_document(self.fleet, sequence, self.clock.wall(), "router-a", lease, risk)


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    """Recompute the checksum the way the writer does (sha256 over sorted-key JSON)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    digest = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return {**body, "checksum": "sha256:" + digest}


def encode(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path)


@pytest.fixture
def rig(config: Config) -> Rig:
    r = Rig(config)
    r.populate()
    return r


@pytest.fixture
def saved(rig: Rig) -> dict[str, Any]:
    return rig.build()


# --------------------------------------------------------------------------- the document
def test_the_document_validates_against_the_shipped_schema(saved: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA_JSON)
    jsonschema.Draft202012Validator(SCHEMA_JSON).validate(saved)
    # ... also after the round trip through the bytes the writer produces
    jsonschema.Draft202012Validator(SCHEMA_JSON).validate(orjson.loads(encode(saved)))


def test_the_document_has_exactly_the_specified_top_level_fields(saved: dict[str, Any]) -> None:
    assert set(saved) == {
        "schema", "sequence", "written_at", "writer", "engine_set", "engines",
        "consolidation_risk", "counters", "lease", "checksum",
    }  # fmt: skip
    assert saved["schema"] == SCHEMA == "narwhal.handoff/1"
    assert saved["sequence"] == 7
    assert saved["written_at"] == 1_800_000_005.0  # the fake wall clock, after 5 s
    assert saved["writer"] == {"router_id": "router-a", "pid": os.getpid(), "lease_epoch": 4}
    assert saved["lease"] == LEASE
    assert saved["checksum"].startswith("sha256:")
    assert saved == seal(saved)


def test_the_engine_set_lists_every_member_with_its_url_and_how_it_is_configured(
    saved: dict[str, Any],
) -> None:
    assert saved["engine_set"] == [
        {"id": e["id"], "url": e["url"], "role": e["role"], "model": "demo-model"} for e in ENGINES
    ]
    assert list(saved["engines"]) == [e["id"] for e in ENGINES]


def test_each_engine_carries_role_ejection_holds_verification_and_generation(
    saved: dict[str, Any],
) -> None:
    t0, t5 = 1_800_000_000.0, 1_800_000_005.0
    e = saved["engines"]
    assert e["p0"] == {"role": "prefill", "ejection": None, "holds": [],
                       "inference_verification": None, "generation": 1_799_990_000.25,
                       "verified": True, "max_model_len": None, "served": [],
                       "adapters": []}  # fmt: skip
    assert e["p1"]["holds"] == [
        {"name": "operator_drain", "reason": "operator request", "since": t0, "deadline": None}
    ]
    assert e["p2"]["inference_verification"] == {"reason": "stream streak: 3 x stall", "since": t0}
    assert e["p2"]["holds"] == [  # the verification hold is not repeated among the holds
        {"name": "performance_drift", "reason": "3.1x role median", "since": t0,
         "deadline": t0 + DRIFT_S}
    ]  # fmt: skip
    assert [h["name"] for h in e["d0"]["holds"]] == ["planned_maintenance"]
    assert e["d0"]["generation"] == 1_799_990_100.5
    assert e["d1"]["ejection"] == {
        "cause": "connection", "reason": "connection streak: refused", "at": t0,
        "evidence": {"connection": 3},
    }  # fmt: skip
    assert e["d1"]["holds"] == [
        {"name": "failure_quarantine", "reason": "connection: connection streak: refused",
         "since": t0, "deadline": t0 + QUARANTINE_S}
    ]  # fmt: skip
    assert e["d2"]["ejection"]["cause"] == "liveness"
    assert e["d2"]["ejection"]["at"] == t5
    assert e["d2"]["holds"] == []
    assert e["d3"] == {"role": "decode", "ejection": None, "holds": [],
                       "inference_verification": None, "generation": None,
                       "verified": True, "max_model_len": None, "served": [],
                       "adapters": []}  # fmt: skip
    assert e["d2"]["verified"] is False


def test_consolidation_risk_and_counters_are_recorded(saved: dict[str, Any]) -> None:
    # prefill: p0 only (p1 drained, p2 held); decode: d3 only (d0 maintenance, d1/d2 ejected)
    assert saved["consolidation_risk"] == {
        "prefill": {"eligible": 1, "busiest_share": 0.0, "high": True},
        "decode": {"eligible": 1, "busiest_share": 0.0, "high": True},
    }
    assert saved["counters"] == {
        "failures": {"d1": {"connection": 3}, "p0": {"timeout": 1}},
        "ejections": {"d1": 1, "d2": 1, "d3": 1},
        "readmissions": {"d3": 1},
    }


def test_without_a_lease_the_writer_has_no_epoch_and_the_lease_is_null(rig: Rig) -> None:
    doc = rig.build(lease=None)
    assert doc["writer"]["lease_epoch"] is None
    assert doc["lease"] is None
    jsonschema.Draft202012Validator(SCHEMA_JSON).validate(doc)


def test_monitor_failure_counters_and_transient_evidence_are_not_in_the_document(
    saved: dict[str, Any],
) -> None:
    def keys(value: Any) -> set[str]:
        if isinstance(value, dict):
            return set(value).union(*(keys(v) for v in value.values()))
        if isinstance(value, list):
            return set().union(*(keys(v) for v in value))
        return set()

    found = keys(saved)
    for word in ("streak", "monitor", "degraded", "passes", "liveness_misses", "in_flight"):
        assert not [k for k in found if word in k], word
    assert all("evidence" not in e for e in saved["engines"].values())


async def test_the_writer_stage_writes_every_call_with_a_monotonic_sequence(
    config: Config, tmp_path: Path
) -> None:
    rig = Rig(config)
    path = tmp_path / "state" / "handoff.json"
    path.parent.mkdir(exist_ok=True)
    writer = HandoffWriter(path, "router-a", rig.fleet, rig.clock, lambda: {}, lambda: dict(LEASE))
    seen = []
    for _ in range(4):
        await writer.stage(rig.clock.monotonic())
        doc = json.loads(path.read_bytes())
        jsonschema.Draft202012Validator(SCHEMA_JSON).validate(doc)
        assert writer.last_document == doc
        seen.append((doc["sequence"], doc["written_at"]))
        rig.clock.advance(1.5)
    assert seen == [(n + 1, 1_800_000_000.0 + 1.5 * n) for n in range(4)]
    assert writer.writes == 4
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_continue_from_never_moves_the_sequence_backwards(config: Config, tmp_path: Path) -> None:
    rig = Rig(config)
    writer = HandoffWriter(tmp_path / "h.json", "r", rig.fleet, rig.clock, dict, lambda: None)
    writer.continue_from({"sequence": 41})
    assert writer.document()["sequence"] == 42
    writer.continue_from({"sequence": 3})
    assert writer.document()["sequence"] == 42


# --------------------------------------------------------------------------- check_document
def reason(raw: bytes | None, config: Config) -> str:
    verdict = check_document(raw, config, SCHEMA_JSON)
    assert not verdict.ok
    assert verdict.document is None
    return verdict.reason


def test_a_good_document_is_accepted(saved: dict[str, Any], config: Config) -> None:
    verdict = check_document(encode(saved), config, SCHEMA_JSON)
    assert verdict.ok
    assert verdict.reason == "applied handoff sequence 7 from router-a"
    assert verdict.document == saved


def test_a_missing_file_is_refused(config: Config) -> None:
    assert reason(None, config) == "no handoff file"


@pytest.mark.parametrize("cut", [0, 1, 2, 100, 0.5, -40, -2, -1])
def test_a_truncated_file_is_refused(saved: dict[str, Any], config: Config, cut: float) -> None:
    raw = encode(saved)
    at = int(len(raw) * cut) if isinstance(cut, float) else cut
    assert reason(raw[:at], config).startswith("not valid JSON (truncated or corrupt): ")


@pytest.mark.parametrize(
    "raw", [b"hello", b"\x00\x00\x00\x00", b"\xff\xfe{}", b"{'schema': 1}", b"{} {}"]
)
def test_a_file_that_is_not_json_is_refused(raw: bytes, config: Config) -> None:
    assert reason(raw, config).startswith("not valid JSON (truncated or corrupt): ")


@pytest.mark.parametrize("raw", [b"[]", b"null", b"42", b'"narwhal.handoff/1"'])
def test_json_that_is_not_an_object_is_refused(raw: bytes, config: Config) -> None:
    assert reason(raw, config) == "not a JSON object"


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ("narwhal.handoff/2", "schema 'narwhal.handoff/2' does not match 'narwhal.handoff/1'"),
        ("narwhal.handoff/0", "schema 'narwhal.handoff/0' does not match 'narwhal.handoff/1'"),
        (None, "schema None does not match 'narwhal.handoff/1'"),
        (1, "schema 1 does not match 'narwhal.handoff/1'"),
    ],
)
def test_a_different_schema_version_is_refused(
    saved: dict[str, Any], config: Config, schema: Any, expected: str
) -> None:
    # Resealed, so only the version differs: a newer router's perfectly valid document.
    assert reason(encode(seal({**saved, "schema": schema})), config) == expected


def test_a_document_without_a_schema_field_is_refused(
    saved: dict[str, Any], config: Config
) -> None:
    doc = seal({k: v for k, v in saved.items() if k != "schema"})
    assert reason(encode(doc), config) == "schema None does not match 'narwhal.handoff/1'"


def _without(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != key}


SCHEMA_VIOLATIONS = [
    pytest.param(
        lambda d: {**d, "sequence": 0},
        "fails the schema at sequence: 0 is less than the minimum of 1",
        id="sequence-0",
    ),
    pytest.param(
        lambda d: {**d, "sequence": "7"},
        "fails the schema at sequence: '7' is not of type 'integer'",
        id="sequence-string",
    ),
    pytest.param(
        lambda d: _without(d, "lease"),
        "fails the schema at (document): 'lease' is a required property",
        id="lease-missing",
    ),
    pytest.param(
        lambda d: _without(d, "checksum"),
        "fails the schema at (document): 'checksum' is a required property",
        id="checksum-missing",
    ),
    pytest.param(
        lambda d: {**d, "monitor_streak": 2},
        "fails the schema at (document): Additional properties are not allowed "
        "('monitor_streak' was unexpected)",
        id="extra-field",
    ),
    pytest.param(
        lambda d: {**d, "engines": {**d["engines"], "p0": {**d["engines"]["p0"], "role": "x"}}},
        "fails the schema at engines/p0/role: 'x' is not one of ['prefill', 'decode', 'both']",
        id="bad-role",
    ),
    pytest.param(
        lambda d: {**d, "engines": {**d["engines"], "p0": {**d["engines"]["p0"], "verified": 1}}},
        "fails the schema at engines/p0/verified: 1 is not of type 'boolean'",
        id="verified-not-boolean",
    ),
    pytest.param(
        lambda d: {**d, "checksum": "md5:abc"},
        "fails the schema at checksum: 'md5:abc' does not match '^sha256:[0-9a-f]{64}$'",
        id="bad-checksum-format",
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), SCHEMA_VIOLATIONS)
def test_a_schema_violation_is_refused_with_its_location(
    saved: dict[str, Any], config: Config, mutate: Any, expected: str
) -> None:
    assert reason(encode(mutate(saved)), config) == expected


TAMPERINGS = [
    pytest.param(lambda d: d.__setitem__("sequence", d["sequence"] + 1000), id="sequence"),
    pytest.param(lambda d: d["engines"]["p1"].__setitem__("holds", []), id="drain-removed"),
    pytest.param(lambda d: d["engines"]["d1"].__setitem__("ejection", None), id="unejected"),
    pytest.param(lambda d: d["engines"]["p0"].__setitem__("generation", 1.0), id="generation"),
    pytest.param(lambda d: d["counters"]["ejections"].__setitem__("d1", 0), id="counter"),
    pytest.param(lambda d: d["writer"].__setitem__("router_id", "mallory"), id="writer"),
    pytest.param(lambda d: d["lease"].__setitem__("epoch", 99), id="lease-epoch"),
]


@pytest.mark.parametrize("tamper", TAMPERINGS)
def test_a_tampered_value_is_refused_by_the_checksum(
    saved: dict[str, Any], config: Config, tamper: Any
) -> None:
    doc = json.loads(encode(saved))
    tamper(doc)
    raw = json.dumps(doc, indent=2).encode()
    jsonschema.Draft202012Validator(SCHEMA_JSON).validate(json.loads(raw))  # still valid JSON
    assert reason(raw, config) == (
        "checksum mismatch: the document was modified after it was written"
    )


def test_a_tampered_byte_inside_a_string_is_refused_by_the_checksum(
    saved: dict[str, Any], config: Config
) -> None:
    raw = encode(saved).replace(b"operator request", b"operator reqvest")
    assert reason(raw, config) == (
        "checksum mismatch: the document was modified after it was written"
    )


def test_reformatting_the_json_is_not_tampering(saved: dict[str, Any], config: Config) -> None:
    compact = json.dumps(saved, separators=(",", ":"), sort_keys=True).encode()
    assert check_document(compact, config, SCHEMA_JSON).ok


def test_an_engine_added_to_the_config_is_refused(saved: dict[str, Any], tmp_path: Path) -> None:
    grown = make_config(tmp_path, [*ENGINES, {"id": "p9", "url": "http://127.0.0.1:9009",
                                              "role": "prefill"}])  # fmt: skip
    assert reason(encode(saved), grown) == (
        "engine set differs from the config: in config only ['p9'], in handoff only []"
    )


def test_an_engine_removed_from_the_config_is_refused(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    shrunk = make_config(tmp_path, [e for e in ENGINES if e["id"] != "d1"])
    assert reason(encode(saved), shrunk) == (
        "engine set differs from the config: in config only [], in handoff only ['d1']"
    )


def test_an_engine_whose_url_changed_is_refused(saved: dict[str, Any], tmp_path: Path) -> None:
    moved = [e if e["id"] != "p0" else {**e, "url": "http://127.0.0.1:9999"} for e in ENGINES]
    assert reason(encode(saved), make_config(tmp_path, moved)) == (
        "engine set differs from the config: in config only ['p0'], in handoff only ['p0']"
    )


def test_an_engine_renamed_in_the_config_is_refused(saved: dict[str, Any], tmp_path: Path) -> None:
    renamed = [e if e["id"] != "d3" else {**e, "id": "d9"} for e in ENGINES]
    assert reason(encode(saved), make_config(tmp_path, renamed)) == (
        "engine set differs from the config: in config only ['d9'], in handoff only ['d3']"
    )


def test_a_reordered_config_is_the_same_engine_set(saved: dict[str, Any], tmp_path: Path) -> None:
    assert check_document(encode(saved), make_config(tmp_path, ENGINES[::-1]), SCHEMA_JSON).ok


def test_engines_that_do_not_match_the_engine_set_are_refused(
    saved: dict[str, Any], config: Config
) -> None:
    engines = {k: v for k, v in saved["engines"].items() if k != "d3"}
    assert reason(encode(seal({**saved, "engines": engines})), config) == (
        "impossible values: engines do not match engine_set"
    )


def test_a_role_the_kv_role_forbids_is_refused(rig: Rig, config: Config) -> None:
    rig.fleet.apply(RoleChanged("p0", Role.DECODE, "test"), rig.clock.monotonic())
    assert reason(encode(rig.build()), config) == (
        "impossible values: p0 role decode is not permitted by kv_role kv_producer"
    )


# --------------------------------------------------------------------------- apply_document
def restored(saved: dict[str, Any], config: Config, clock: FakeClock) -> Rig:
    fresh = Rig(config, clock)
    verdict = check_document(encode(saved), config, SCHEMA_JSON)
    assert verdict.ok and verdict.document is not None
    apply_document(verdict.document, fresh.fleet, fresh.clock)
    return fresh


def after_restart(down_s: float) -> FakeClock:
    """A new process: its monotonic clock has a different origin; the wall clock moved on."""
    return FakeClock(monotonic=50.0, wall=1_800_000_005.0 + down_s)


def test_apply_restores_roles_ejections_holds_generations_and_counters(
    rig: Rig, saved: dict[str, Any], config: Config
) -> None:
    fresh = restored(saved, config, after_restart(10.0))
    for engine in rig.fleet:
        again = fresh.fleet.get(engine.id)
        assert again.role is engine.role
        assert again.ejected == engine.ejected
        assert again.generation == engine.generation
        assert again.verified == engine.verified, engine.id
        assert set(again.holds) == set(engine.holds), engine.id
        for name, hold in engine.holds.items():
            assert again.holds[name].reason == hold.reason
            assert again.holds[name].since_wall == hold.since_wall
            assert again.holds[name].deadline_wall == hold.deadline_wall
    assert fresh.fleet.counters == rig.fleet.counters
    # Rebuilt from the restored fleet, the document says the same thing.
    rebuilt = fresh.build()
    for key in ("engine_set", "engines", "counters"):
        assert rebuilt[key] == saved[key]


def test_apply_restores_drains_maintenance_and_inference_holds_that_block_placement(
    saved: dict[str, Any], config: Config
) -> None:
    fresh = restored(saved, config, after_restart(10.0))
    now = fresh.clock.monotonic()
    assert HoldName.OPERATOR_DRAIN in fresh.fleet.get("p1").active_holds_by_name(now)
    assert HoldName.PLANNED_MAINTENANCE in fresh.fleet.get("d0").active_holds_by_name(now)
    assert HoldName.INFERENCE_VERIFICATION in fresh.fleet.get("p2").active_holds_by_name(now)
    assert [c.id for c in fresh.fleet.candidates(Role.PREFILL, now)] == ["p0"]
    assert [c.id for c in fresh.fleet.candidates(Role.DECODE, now)] == ["d3"]
    # Drains and maintenance have no deadline: a long outage does not end them.
    later = restored(saved, config, after_restart(10 * 86_400.0))
    assert HoldName.OPERATOR_DRAIN in later.fleet.get("p1").holds
    assert HoldName.PLANNED_MAINTENANCE in later.fleet.get("d0").holds
    assert HoldName.INFERENCE_VERIFICATION in later.fleet.get("p2").holds


def test_an_unverified_engine_is_restored_unverified_and_never_a_candidate(
    saved: dict[str, Any], config: Config
) -> None:
    fresh = restored(saved, config, after_restart(10.0))
    d2 = fresh.fleet.get("d2")
    assert d2.verified is False and d2.unverified_reason is not None
    assert all(e.verified for e in fresh.fleet if e.id != "d2")
    # Readmitted (the pipeline checks health and the model), it is verified and eligible.
    fresh.lifecycle.readmit(d2, "verified", fresh.clock.monotonic())
    d2 = fresh.fleet.get("d2")
    assert d2.verified is True and d2.unverified_reason is None
    assert "d2" in [c.id for c in fresh.fleet.candidates(Role.DECODE, fresh.clock.monotonic())]


def test_a_document_without_verified_means_verified(saved: dict[str, Any], config: Config) -> None:
    """A router that predates verification wrote no `verified` and served from every engine
    it listed: its document restores them verified (schema 1 keeps the field optional)."""
    older = {**saved, "engines": {i: _without(e, "verified") for i, e in saved["engines"].items()}}
    older = seal(older)
    jsonschema.Draft202012Validator(SCHEMA_JSON).validate(older)
    fresh = restored(older, config, after_restart(10.0))
    assert all(e.verified for e in fresh.fleet)


def test_a_learned_max_model_len_is_carried_so_an_heir_judges_prompt_lengths_at_once(
    rig: Rig, config: Config
) -> None:
    """A standby runs no pass, so it never reads /v1/models itself: without the saved limit,
    its first requests after a takeover could not be length-checked (an over-long prompt
    would reach an engine, whose vLLM-style 500 is charged to it)."""
    rig.fleet.apply(ModelLimitLearned("p0", 4096), rig.clock.monotonic())
    saved = rig.build()
    assert saved["engines"]["p0"]["max_model_len"] == 4096
    fresh = restored(saved, config, after_restart(10.0))
    assert fresh.fleet.get("p0").max_model_len == 4096
    assert fresh.fleet.get("p1").max_model_len is None
    # A document without it (an older router's) leaves what the heir knows as it is.
    fresh.fleet.apply(ModelLimitLearned("p1", 2048), fresh.clock.monotonic())
    older = seal({**saved, "engines": {i: _without(e, "max_model_len")
                                       for i, e in saved["engines"].items()}})  # fmt: skip
    apply_document(older, fresh.fleet, fresh.clock)
    assert fresh.fleet.get("p1").max_model_len == 2048


def test_a_fresh_fleet_is_unverified_and_the_document_says_so(config: Config) -> None:
    fresh = Rig(config)
    doc = fresh.build()
    assert {e["verified"] for e in doc["engines"].values()} == {False}
    assert fresh.fleet.candidates(Role.PREFILL, fresh.clock.monotonic()) == []
    assert fresh.fleet.roles_without_verified() == [Role.PREFILL, Role.DECODE]


def test_a_deadline_still_ahead_keeps_its_remaining_time_on_the_new_monotonic_clock(
    saved: dict[str, Any], config: Config
) -> None:
    down_s = 20.0  # the quarantine was set 5 s before the save: 95 s remain
    fresh = restored(saved, config, after_restart(down_s))
    hold = fresh.fleet.get("d1").holds[HoldName.FAILURE_QUARANTINE]
    assert hold.deadline_wall == 1_800_000_000.0 + QUARANTINE_S
    remaining = QUARANTINE_S - 5.0 - down_s
    assert hold.deadline_mono == pytest.approx(50.0 + remaining)
    assert not hold.expired(50.0 + remaining - 0.01)
    assert hold.expired(50.0 + remaining)
    fresh.clock.advance(remaining)
    assert [c.id for c in fresh.fleet.candidates(Role.PREFILL, fresh.clock.monotonic())] == ["p0"]


@pytest.mark.parametrize("down_s", [QUARANTINE_S - 5.0, QUARANTINE_S, 3600.0])
def test_a_deadline_that_passed_while_down_is_treated_as_passed(
    saved: dict[str, Any], config: Config, down_s: float
) -> None:
    fresh = restored(saved, config, after_restart(down_s))
    d1, p2 = fresh.fleet.get("d1"), fresh.fleet.get("p2")
    assert HoldName.FAILURE_QUARANTINE not in d1.holds  # passed: no longer quarantined
    assert d1.ejected is not None  # but still ejected: readmission must verify it
    assert HoldName.PERFORMANCE_DRIFT not in p2.holds  # drift ended 25 s after the save
    assert HoldName.INFERENCE_VERIFICATION in p2.holds  # no deadline: still held


def test_apply_does_not_restore_evidence_liveness_or_in_flight(
    saved: dict[str, Any], config: Config
) -> None:
    fresh = restored(saved, config, after_restart(1.0))
    for engine in fresh.fleet:
        assert engine.evidence == {}
        assert engine.liveness_misses == 0
        assert fresh.fleet.in_flight.of(engine.id) == 0


class FailDirFsyncOnce(Filesystem):
    """The rename succeeds, then the directory fsync fails once (EIO)."""

    def __init__(self) -> None:
        self.failed = False

    def fsync_dir(self, path: Path) -> None:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EIO, "Input/output error")
        super().fsync_dir(path)


async def test_a_directory_fsync_failure_after_the_rename_is_an_accepted_write(
    config: Config, tmp_path: Path
) -> None:
    """The document reached the destination: accepted (sequence advances), counted, no error."""
    rig = Rig(config)
    path = tmp_path / "handoff.json"
    failures: list[None] = []
    writer = HandoffWriter(
        path,
        "r",
        rig.fleet,
        rig.clock,
        dict,
        lambda: None,
        fs=FailDirFsyncOnce(),
        on_dir_fsync_failure=lambda: failures.append(None),
    )
    await writer.stage(rig.clock.monotonic())
    on_disk = json.loads(path.read_bytes())
    assert on_disk["sequence"] == writer.sequence == 1
    assert writer.last_document == on_disk and writer.writes == 1
    assert len(failures) == 1
    rig.clock.advance(1)
    await writer.stage(rig.clock.monotonic())
    assert json.loads(path.read_bytes())["sequence"] == 2
    assert len(failures) == 1


# --------------------------------------------------------------------------- impossible values
T0, T5 = 1_800_000_000.0, 1_800_000_005.0  # the fixture's hold/ejection time and written_at


def _edit(change: Any) -> Any:
    """A mutation on a deep copy of the saved document, resealed (only the value is wrong)."""

    def mutate(doc: dict[str, Any]) -> dict[str, Any]:
        copy = json.loads(encode(doc))
        change(copy)
        return seal(copy)

    return mutate


def _engines(d: dict[str, Any]) -> dict[str, Any]:
    engines: dict[str, Any] = d["engines"]
    return engines


IMPOSSIBLE = [
    pytest.param(
        _edit(lambda d: d["engine_set"].append(dict(d["engine_set"][0]))),
        "impossible values: engine_set lists ['p0'] twice",
        "impossible",
        id="duplicate-engine-id",
    ),
    pytest.param(
        _edit(lambda d: _engines(d)["p1"]["holds"].append(dict(_engines(d)["p1"]["holds"][0]))),
        "impossible values: p1 has 2 operator_drain holds",
        "impossible",
        id="two-drains",
    ),
    pytest.param(
        _edit(lambda d: _engines(d)["p2"]["holds"][0].__setitem__("deadline", T0 - 1)),
        "impossible values: p2 performance_drift hold ends before it began",
        "impossible",
        id="deadline-before-since",
    ),
    pytest.param(
        _edit(lambda d: _engines(d)["p1"]["holds"][0].__setitem__("deadline", T0 + 60)),
        "impossible values: p1 operator_drain hold has a deadline (operator_drain has none)",
        "impossible",
        id="drain-with-deadline",
    ),
    pytest.param(
        _edit(lambda d: _engines(d)["d0"]["holds"][0].__setitem__("deadline", T0 + 60)),
        "impossible values: d0 planned_maintenance hold has a deadline "
        "(planned_maintenance has none)",
        "impossible",
        id="maintenance-with-deadline",
    ),
    pytest.param(
        _edit(lambda d: _engines(d)["d1"]["ejection"].__setitem__("evidence", {"bogus": 3})),
        "fails the schema at engines/d1/ejection/evidence: 'bogus' is not one of ['connection', "
        "'timeout', 'stream', 'overload', 'inference_status', 'kv_handoff']",
        "schema",
        id="evidence-unknown-class",
    ),
    pytest.param(
        _edit(lambda d: _engines(d)["d1"]["ejection"].__setitem__("evidence", {"connection": -3})),
        "fails the schema at engines/d1/ejection/evidence/connection: -3 is less than the "
        "minimum of 0",
        "schema",
        id="evidence-negative",
    ),
    pytest.param(
        _edit(lambda d: _engines(d)["p0"].__setitem__("generation", -1.0)),
        "fails the schema at engines/p0/generation: -1.0 is less than the minimum of 0",
        "schema",
        id="negative-generation",
    ),
    pytest.param(
        _edit(lambda d: d["counters"]["failures"]["p0"].__setitem__("bogus", 1)),
        "fails the schema at counters/failures/p0: 'bogus' is not one of ['connection', "
        "'timeout', 'stream', 'overload', 'inference_status', 'kv_handoff']",
        "schema",
        id="counter-unknown-class",
    ),
    pytest.param(
        _edit(lambda d: d.__setitem__("sequence", 2**64 - 1)),
        "fails the schema at sequence: 18446744073709551615 is greater than the maximum "
        "of 9007199254740991",
        "schema",
        id="sequence-beyond-json-safe",
    ),
    pytest.param(
        _edit(lambda d: d.__setitem__("written_at", T5 + 3600)),
        f"impossible values: written_at {T5 + 3600} is in the future",
        "impossible",
        id="written-in-the-future",
    ),
    pytest.param(
        _edit(lambda d: _engines(d)["d1"]["ejection"].__setitem__("at", T5 + 3600)),
        f"impossible values: d1 ejection at {T5 + 3600} is in the future",
        "impossible",
        id="ejected-in-the-future",
    ),
    pytest.param(
        _edit(lambda d: d["counters"]["failures"].__setitem__("x9", {"timeout": 1})),
        "impossible values: counters.failures for engines not configured: ['x9']",
        "impossible",
        id="failure-counter-unknown-engine",
    ),
    pytest.param(
        _edit(lambda d: d["counters"]["ejections"].__setitem__("x9", 1)),
        "impossible values: counters.ejections for engines not configured: ['x9']",
        "impossible",
        id="ejection-counter-unknown-engine",
    ),
    pytest.param(
        _edit(lambda d: d["counters"]["readmissions"].__setitem__("x9", 1)),
        "impossible values: counters.readmissions for engines not configured: ['x9']",
        "impossible",
        id="readmission-counter-unknown-engine",
    ),
]


@pytest.mark.parametrize(("mutate", "expected", "code"), IMPOSSIBLE)
def test_an_impossible_value_is_refused_with_a_clear_reason(
    saved: dict[str, Any], config: Config, mutate: Any, expected: str, code: str
) -> None:
    verdict = check_document(encode(mutate(saved)), config, SCHEMA_JSON, now_wall_s=T5)
    assert (verdict.ok, verdict.reason, verdict.code) == (False, expected, code)
    assert verdict.document is None


def test_times_within_the_clock_skew_allowance_are_accepted(
    saved: dict[str, Any], config: Config
) -> None:
    """A writer whose clock runs ahead of the reader's by less than the allowance is fine."""
    early = T5 - CLOCK_SKEW_ALLOWANCE_S + 1
    assert check_document(encode(saved), config, SCHEMA_JSON, now_wall_s=early).ok
    late = T5 - CLOCK_SKEW_ALLOWANCE_S - 1
    verdict = check_document(encode(saved), config, SCHEMA_JSON, now_wall_s=late)
    assert verdict.reason == f"impossible values: written_at {T5} is in the future"


REASON_CODES = [
    pytest.param(lambda d: None, "missing", id="missing"),
    pytest.param(lambda d: encode(d)[:40], "invalid_json", id="invalid_json"),
    pytest.param(lambda d: b"[]", "not_object", id="not_object"),
    pytest.param(lambda d: encode(seal({**d, "schema": "x/2"})), "schema_version", id="version"),
    pytest.param(lambda d: encode({**d, "sequence": 0}), "schema", id="schema"),
    pytest.param(lambda d: encode({**d, "sequence": 99}), "checksum", id="checksum"),
    pytest.param(lambda d: encode(seal({**d, "engine_set": []})), "engine_set", id="engine_set"),
    pytest.param(lambda d: encode(seal({**d, "engines": {}})), "impossible", id="impossible"),
]


@pytest.mark.parametrize(("make", "code"), REASON_CODES)
def test_every_refusal_carries_its_reason_code(
    saved: dict[str, Any], config: Config, make: Any, code: str
) -> None:
    verdict = check_document(make(saved), config, SCHEMA_JSON)
    assert (verdict.ok, verdict.code) == (False, code)
    assert code in REFUSAL_CODES


def test_an_accepted_document_has_the_code_applied(saved: dict[str, Any], config: Config) -> None:
    assert check_document(encode(saved), config, SCHEMA_JSON, now_wall_s=T5).code == "applied"


@pytest.mark.parametrize(
    ("saved_sequence", "taken"),
    [(41, True), (2**53 - 1, True), (2**53, False), (2**64 - 1, False), (0, False),
     (-5, False), (True, False), (41.0, False), ("41", False), (None, False)],
)  # fmt: skip
def test_only_a_json_safe_saved_sequence_is_continued(
    config: Config, tmp_path: Path, saved_sequence: Any, taken: bool
) -> None:
    rig = Rig(config)
    writer = HandoffWriter(tmp_path / "h.json", "r", rig.fleet, rig.clock, dict, lambda: None)
    writer.sequence = 3
    assert writer.continue_numbering(saved_sequence) is taken
    assert writer.sequence == (saved_sequence if taken else 3)
    orjson.dumps(writer.document())  # the next document still serialises


def _doc(epoch: int | None, sequence: int) -> dict[str, Any]:
    return {"writer": {"lease_epoch": epoch}, "sequence": sequence}


@pytest.mark.parametrize(
    ("own", "followed", "expected"),
    [
        (None, None, None),
        (_doc(3, 10), None, _doc(3, 10)),
        (None, _doc(3, 10), _doc(3, 10)),
        (_doc(3, 50), _doc(4, 2), _doc(4, 2)),  # a fenced ex-active: the newer epoch wins
        (_doc(4, 9), _doc(4, 8), _doc(4, 9)),
        (_doc(4, 8), _doc(4, 9), _doc(4, 9)),
        (_doc(None, 7), _doc(1, 1), _doc(1, 1)),
    ],
)
def test_the_newest_document_is_by_epoch_then_sequence(
    own: dict[str, Any] | None, followed: dict[str, Any] | None, expected: Any
) -> None:
    assert newest(own, followed) == expected


def test_an_entry_keeps_what_differs_from_the_defaults_and_reads_back() -> None:
    """`engine_set` entries carry what a standby needs to add an engine, and no more."""
    config = parse_config(
        {
            "model": "demo-model",
            "engines": [
                {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill",
                 "kv_role": "kv_both"},
                {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode", "model": "m2",
                 "api_key_env": "D0_KEY"},
            ],
        }
    )  # fmt: skip
    fleet = Fleet(config.engines, FakeClock())
    entries = [member_entry(e) for e in fleet]
    assert entries == [
        {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill", "kv_role": "kv_both",
         "model": "demo-model"},
        {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode", "api_key_env": "D0_KEY",
         "model": "m2"},
    ]  # fmt: skip
    members = members_of({"engine_set": entries}, config)
    assert [c for c, _ in members] == list(config.engines)
    assert [o for _, o in members] == ["config", "config"]
