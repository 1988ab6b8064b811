"""The handoff: the versioned control-plane document written on every monitor pass.

`build_document` captures the fleet (roles, ejections, lifecycle and inference holds with
wall-clock deadlines, generations), consolidation risk, counters and lease ownership, and
seals it with a checksum. `check_document` decides whether a saved document may be applied
to the configured fleet; `apply_document` restores it. Monitor-failure counters are never
part of the document.

Each engine records whether it was `verified` (DESIGN §10); the field is optional in schema 1,
and a document without it (written by a router that predates verification, which served
from every engine it lists) means verified.

The engine set is the membership (DESIGN §10): each entry also says how the engine is
configured (`member_entry`), so that a standby can follow engines added or removed at
runtime. An engine that is leaving is no longer a member and is left out.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import orjson

from narwhal.clock import Clock
from narwhal.config import DEFAULT_KV_ROLE, KV_ROLE_PERMITS, Config, EngineConfig, KvRole, Role
from narwhal.fleet.events import Restored
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.state import Ejection, EngineState
from narwhal.fleet.store import Fleet
from narwhal.state.atomic import Filesystem, atomic_write

SCHEMA = "narwhal.handoff/1"


def load_schema() -> dict[str, Any]:
    text = resources.files("narwhal.state").joinpath("handoff.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def _checksum(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return "sha256:" + hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _hold_json(hold: Hold) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": hold.name.value,
        "reason": hold.reason,
        "since": hold.since_wall,
        "deadline": hold.deadline_wall,
    }
    if hold.newer_than is not None:  # planned maintenance: the generation to beat
        doc["newer_than"] = hold.newer_than
    return doc


def engine_document(engine: EngineState) -> dict[str, Any]:
    verification = engine.holds.get(HoldName.INFERENCE_VERIFICATION)
    return {
        "role": engine.role.value,
        "ejection": engine.ejected.to_json() if engine.ejected else None,
        "holds": [
            _hold_json(h)
            for h in engine.holds.values()
            if h.name is not HoldName.INFERENCE_VERIFICATION
        ],
        "inference_verification": (
            {"reason": verification.reason, "since": verification.since_wall}
            if verification
            else None
        ),
        "generation": engine.generation,
        "verified": engine.verified,
        "max_model_len": engine.max_model_len,
        "served": sorted(engine.served),
        "adapters": sorted(engine.adapters),
    }


def build_document(
    fleet: Fleet,
    sequence: int,
    written_at: float,
    router_id: str,
    lease: dict[str, Any] | None,
    risk: dict[str, Any],
) -> dict[str, Any]:
    members = [e for e in fleet if e.leaving is None]
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "sequence": sequence,
        "written_at": written_at,
        "writer": {
            "router_id": router_id,
            "pid": os.getpid(),
            "lease_epoch": lease["epoch"] if lease else None,
        },
        "engine_set": [member_entry(e) for e in members],
        "engines": {e.id: engine_document(e) for e in members},
        "consolidation_risk": risk,
        "counters": _members_only(fleet.counters.to_json(), {e.id for e in members}),
        "lease": lease,
    }
    doc["checksum"] = _checksum(doc)
    return doc


def member_entry(engine: EngineState) -> dict[str, Any]:
    """An engine's `engine_set` entry: what a standby needs to add it (never its API key),
    and where its membership comes from."""
    config = engine.config
    entry: dict[str, Any] = {"id": config.id, "url": config.url, "role": config.role.value}
    # What a reader would derive anyway is left out (the document is written every pass).
    if config.effective_kv_role is not DEFAULT_KV_ROLE[config.role]:
        entry["kv_role"] = config.effective_kv_role.value
    if config.api != "vllm":
        entry["api"] = config.api
    if config.api_key_env is not None:
        entry["api_key_env"] = config.api_key_env
    if config.slot_save_path is not None:
        entry["slot_save_path"] = config.slot_save_path
    if engine.origin != "config":
        entry["origin"] = engine.origin
    if config.model is not None:
        entry["model"] = config.model
    return entry


def members_of(doc: dict[str, Any], config: Config) -> list[tuple[EngineConfig, str]]:
    """The membership a document records: each engine's config and origin. An entry without
    its role (a router that predates membership changes wrote it) takes the configured
    engine's."""
    configured = {e.id: e for e in config.engines}
    members = []
    for entry in doc["engine_set"]:
        origin = entry.get("origin", "config")
        if "role" in entry:
            fields = {k: v for k, v in entry.items() if k != "origin"}
            members.append((EngineConfig.model_validate(fields), origin))
        elif entry["id"] in configured:
            engine = configured[entry["id"]].model_copy(update={"url": entry["url"]})
            members.append((engine, origin))
    return members


def _members_only(counters: dict[str, Any], members: set[str]) -> dict[str, Any]:
    failures = {e: by for e, by in counters["failures"].items() if e in members}
    return {
        "failures": failures,
        **{
            kind: {e: n for e, n in counters[kind].items() if e in members}
            for kind in ("ejections", "readmissions")
        },
    }


MAX_SEQUENCE = 2**53 - 1
"""The largest `sequence` a document may carry: exact in every JSON implementation (IEEE
doubles), and far beyond any real run. A larger saved number is refused, never continued."""

CLOCK_SKEW_ALLOWANCE_S = 60.0
"""How far in the future (by the reader's wall clock) a saved time may lie before the document
is called impossible: tolerates clock skew between routers sharing the file."""

UNTIMED_HOLDS = frozenset({HoldName.OPERATOR_DRAIN.value, HoldName.PLANNED_MAINTENANCE.value})
"""Holds that end only by an operator's readmission: a saved deadline on one is impossible."""

REFUSAL_CODES = (
    "missing",
    "unreadable",
    "invalid_json",
    "not_object",
    "schema_version",
    "schema",
    "checksum",
    "engine_set",
    "impossible",
)
"""The fixed set of `Verdict.code` values of a refusal (the `reason` label of
`narwhal_handoff_resume_refusals_total`)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a saved handoff may be applied, and exactly why not (`code`: one of
    `REFUSAL_CODES`, or `applied`)."""

    ok: bool
    reason: str
    document: dict[str, Any] | None = None
    code: str = "applied"


def refused(code: str, reason: str) -> Verdict:
    assert code in REFUSAL_CODES, code
    return Verdict(False, reason, None, code)


def check_document(
    raw: bytes | None,
    config: Config | None,
    schema: dict[str, Any],
    *,
    now_wall_s: float | None = None,
    membership: bool = False,
) -> Verdict:
    """Validate a saved handoff against the schema, its checksum and the configured fleet.

    `membership` (a standby following the active): the document's engine set is the fleet,
    whatever the config says; a standby takes its membership changes (DESIGN §10).

    `now_wall_s` (the reader's wall clock) enables the check that no saved time lies in the
    future beyond `CLOCK_SKEW_ALLOWANCE_S`; without it that check is skipped. `config` None
    (`narwhal handoff validate` without `--config`) skips what needs the configuration: the
    engine set comparison and the kv_role permits."""
    if raw is None:
        return refused("missing", "no handoff file")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return refused("invalid_json", f"not valid JSON (truncated or corrupt): {exc}")
    if not isinstance(doc, dict):
        return refused("not_object", "not a JSON object")
    if doc.get("schema") != SCHEMA:
        return refused("schema_version", f"schema {doc.get('schema')!r} does not match {SCHEMA!r}")
    complaint = schema_complaint(doc, schema)
    if complaint is not None:
        return refused("schema", complaint)
    if doc["checksum"] != _checksum(doc):
        return refused(
            "checksum", "checksum mismatch: the document was modified after it was written"
        )
    ids = [e["id"] for e in doc["engine_set"]]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        return refused("impossible", f"impossible values: engine_set lists {duplicates} twice")
    saved = {(e["id"], e["url"]) for e in doc["engine_set"]}
    configured = saved if config is None or membership else {(e.id, e.url) for e in config.engines}
    if saved != configured:
        added = sorted(i for i, _ in configured - saved)
        removed = sorted(i for i, _ in saved - configured)
        return refused(
            "engine_set",
            f"engine set differs from the config: in config only {added}, "
            f"in handoff only {removed}",
        )
    problem = impossible_values(doc, config, now_wall_s)
    if problem is not None:
        return refused("impossible", f"impossible values: {problem}")
    return Verdict(
        True, f"applied handoff sequence {doc['sequence']} from {doc['writer']['router_id']}", doc
    )


def shape_complaint(doc: Any, schema: dict[str, Any]) -> str | None:
    """What is wrong with a parsed document's shape (object, version, schema), or None: the
    checks that need neither the checksum nor a configuration (`narwhal handoff show`)."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("schema") != SCHEMA:
        return f"schema {doc.get('schema')!r} does not match {SCHEMA!r}"
    return schema_complaint(doc, schema)


def schema_complaint(doc: Any, schema: dict[str, Any]) -> str | None:
    """The JSON Schema's most relevant complaint about `doc`, or None when it validates."""
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(doc)
    )
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(document)"
    return f"fails the schema at {where}: {error.message}"


def impossible_values(
    doc: dict[str, Any], config: Config | None, now_wall_s: float | None
) -> str | None:
    """What a schema-valid document with a good checksum may still get wrong: values no router
    writes, which applied would give the fleet a state it cannot reach (None: nothing).
    Called once the engine set matches the config, so the document's own engine_set stands
    for the configured ids; `config` None skips only the kv_role permits."""
    configured = {e["id"] for e in doc["engine_set"]}
    kv_roles = {} if config is None else {e.id: e.effective_kv_role for e in config.engines}
    for entry in doc["engine_set"]:  # an engine added at runtime: the kv_role it was given
        if "kv_role" in entry and entry["id"] not in kv_roles:
            kv_roles[entry["id"]] = KvRole(entry["kv_role"])
    if set(doc["engines"]) != configured:
        return "engines do not match engine_set"
    latest = None if now_wall_s is None else now_wall_s + CLOCK_SKEW_ALLOWANCE_S
    if latest is not None and doc["written_at"] > latest:
        return f"written_at {doc['written_at']} is in the future"
    for engine_id in sorted(configured):
        saved = doc["engines"][engine_id]
        role = Role(saved["role"])
        kv_role = kv_roles.get(engine_id)
        if kv_role is not None and role not in KV_ROLE_PERMITS[kv_role]:
            return f"{engine_id} role {role.value} is not permitted by kv_role {kv_role.value}"
        ejection = saved["ejection"]
        if ejection is not None and latest is not None and ejection["at"] > latest:
            return f"{engine_id} ejection at {ejection['at']} is in the future"
        names = [h["name"] for h in saved["holds"]]
        for hold in saved["holds"]:
            name = hold["name"]
            if names.count(name) > 1:
                return f"{engine_id} has {names.count(name)} {name} holds"
            if name in UNTIMED_HOLDS and hold["deadline"] is not None:
                return f"{engine_id} {name} hold has a deadline ({name} has none)"
            if hold["deadline"] is not None and hold["deadline"] < hold["since"]:
                return f"{engine_id} {name} hold ends before it began"
    counters = doc["counters"]
    for kind in ("failures", "ejections", "readmissions"):
        unknown = sorted(set(counters[kind]) - configured)
        if unknown:
            return f"counters.{kind} for engines not configured: {unknown}"
    return None


def apply_document(doc: dict[str, Any], fleet: Fleet, clock: Clock) -> None:
    """Restore engine state, one `Restored` event per engine (a change is logged `from -> to`,
    re-applying what is already there stays silent); hold deadlines that passed meanwhile are
    treated as passed."""
    now_mono, now_wall = clock.monotonic(), clock.wall()
    for engine_id, saved in doc["engines"].items():
        ej = saved["ejection"]
        ejected = (
            Ejection(ej["cause"], ej["reason"], ej["at"], dict(ej["evidence"])) if ej else None
        )
        holds: dict[HoldName, Hold] = {}
        for h in saved["holds"]:
            deadline = h["deadline"]
            if deadline is not None and deadline <= now_wall:
                continue
            holds[HoldName(h["name"])] = Hold(
                HoldName(h["name"]),
                h["reason"],
                h["since"],
                deadline_mono=None if deadline is None else now_mono + (deadline - now_wall),
                deadline_wall=deadline,
                newer_than=h.get("newer_than"),
            )
        if saved["inference_verification"]:
            v = saved["inference_verification"]
            holds[HoldName.INFERENCE_VERIFICATION] = Hold(
                HoldName.INFERENCE_VERIFICATION, v["reason"], v["since"]
            )
        restored = Restored(
            engine_id,
            Role(saved["role"]),
            saved["generation"],
            # An heir that never ran a pass can judge prompt lengths from its first request.
            saved.get("max_model_len"),
            ejected,
            holds,
            bool(saved.get("verified", True)),  # absent: an older router served from it
            # Absent (an older router): read again from the engine at the next health check.
            _names(saved.get("served")),
            _names(saved.get("adapters")),
        )
        fleet.apply(restored, now_mono)
    fleet.counters.restore(doc["counters"])


def _names(saved: list[str] | None) -> frozenset[str] | None:
    return None if saved is None else frozenset(saved)


def newest(*docs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The most recent of some documents by (writer lease epoch, sequence): what a fenced
    ex-active reports is the newer document it followed, not its own older write."""
    present = [d for d in docs if d is not None]
    if not present:
        return None
    return max(present, key=lambda d: (d["writer"]["lease_epoch"] or 0, d["sequence"]))


GuardedWrite = Callable[[dict[str, Any], bytes], Awaitable[None]]
"""A lease-guarded write: writes (and `accept`s) only while this router holds the epoch."""


class HandoffWriter:
    """The `handoff` monitor stage: build, seal and atomically write the document."""

    def __init__(
        self,
        path: Path,
        router_id: str,
        fleet: Fleet,
        clock: Clock,
        risk: Callable[[], dict[str, Any]],
        lease: Callable[[], dict[str, Any] | None],
        fs: Filesystem | None = None,
        on_dir_fsync_failure: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self._router_id = router_id
        self._on_dir_fsync_failure = on_dir_fsync_failure
        self._fleet = fleet
        self._clock = clock
        self._risk = risk
        self._lease = lease
        self._fs = fs or Filesystem()
        self.guard: GuardedWrite | None = None
        self.sequence = 0
        self.last_document: dict[str, Any] | None = None
        self.writes = 0

    def document(self) -> dict[str, Any]:
        return build_document(
            self._fleet,
            self.sequence + 1,
            self._clock.wall(),
            self._router_id,
            self._lease(),
            self._risk(),
        )

    async def write_local(self, data: bytes) -> None:
        await asyncio.to_thread(atomic_write, self.path, data, 0o600, self._fs, self.unsynced)

    def unsynced(self, exc: OSError) -> None:
        """A write whose directory fsync failed after the rename: the document is in place and
        accepted, but counted (it may not survive a crash). Called from the writing thread."""
        if self._on_dir_fsync_failure is not None:
            self._on_dir_fsync_failure()

    def accept(self, doc: dict[str, Any]) -> None:
        self.sequence = doc["sequence"]
        self.last_document = doc
        self.writes += 1

    async def stage(self, now: float) -> None:
        doc = self.document()
        # A sequence number is consumed even if the write fails: a number is never reused.
        self.sequence = doc["sequence"]
        data = orjson.dumps(doc, option=orjson.OPT_INDENT_2)
        if self.guard is not None:
            await self.guard(doc, data)
            return
        await self.write_local(data)
        self.accept(doc)

    def continue_from(self, doc: dict[str, Any]) -> None:
        """Keep the sequence monotonic across restarts and takeovers."""
        self.sequence = max(self.sequence, int(doc["sequence"]))
        self.last_document = doc

    def continue_numbering(self, saved: object) -> bool:
        """Continue from a saved file's raw `sequence` (not applied otherwise): an integer in
        [1, MAX_SEQUENCE] is taken; anything else is ignored (False). An out-of-range number,
        if taken, would make every later write fail to serialise."""
        if isinstance(saved, bool) or not isinstance(saved, int):
            return False
        if not 1 <= saved <= MAX_SEQUENCE:
            return False
        self.sequence = max(self.sequence, saved)
        return True


class UnreadableHandoff(Exception):
    """The handoff path exists but cannot be read (a directory, EACCES, EIO...)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot read {path}: {reason}")
        self.reason = reason


def read_handoff(path: Path) -> bytes | None:
    """The saved bytes; None when there is no file; UnreadableHandoff otherwise."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UnreadableHandoff(path, exc.strerror or str(exc)) from None
