"""The handoff: the versioned control-plane document written on every monitor pass.

`build_document` captures the fleet (roles, ejections, lifecycle and inference holds with
wall-clock deadlines, generations), consolidation risk, counters and lease ownership, and
seals it with a checksum. `check_document` decides whether a saved document may be applied
to the configured fleet; `apply_document` restores it. Monitor-failure counters are never
part of the document.
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
from narwhal.config import KV_ROLE_PERMITS, Config, Role
from narwhal.control.fleet import Ejection, EngineState, Fleet
from narwhal.control.holds import Hold, HoldName
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
    return {
        "name": hold.name.value,
        "reason": hold.reason,
        "since": hold.since_wall,
        "deadline": hold.deadline_wall,
    }


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
    }


def build_document(
    fleet: Fleet,
    sequence: int,
    written_at: float,
    router_id: str,
    lease: dict[str, Any] | None,
    risk: dict[str, Any],
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "sequence": sequence,
        "written_at": written_at,
        "writer": {
            "router_id": router_id,
            "pid": os.getpid(),
            "lease_epoch": lease["epoch"] if lease else None,
        },
        "engine_set": [{"id": e.id, "url": e.config.url} for e in fleet],
        "engines": {e.id: engine_document(e) for e in fleet},
        "consolidation_risk": risk,
        "counters": fleet.counters.to_json(),
        "lease": lease,
    }
    doc["checksum"] = _checksum(doc)
    return doc


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a saved handoff may be applied, and exactly why not."""

    ok: bool
    reason: str
    document: dict[str, Any] | None = None


def check_document(raw: bytes | None, config: Config, schema: dict[str, Any]) -> Verdict:
    """Validate a saved handoff against the schema, its checksum and the configured fleet."""
    if raw is None:
        return Verdict(False, "no handoff file")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Verdict(False, f"not valid JSON (truncated or corrupt): {exc}")
    if not isinstance(doc, dict):
        return Verdict(False, "not a JSON object")
    if doc.get("schema") != SCHEMA:
        return Verdict(False, f"schema {doc.get('schema')!r} does not match {SCHEMA!r}")
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(doc)
    )
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(document)"
        return Verdict(False, f"fails the schema at {where}: {error.message}")
    if doc["checksum"] != _checksum(doc):
        return Verdict(False, "checksum mismatch: the document was modified after it was written")
    saved = {(e["id"], e["url"]) for e in doc["engine_set"]}
    configured = {(e.id, e.url) for e in config.engines}
    if saved != configured:
        added = sorted(i for i, _ in configured - saved)
        removed = sorted(i for i, _ in saved - configured)
        return Verdict(
            False,
            f"engine set differs from the config: in config only {added}, "
            f"in handoff only {removed}",
        )
    if set(doc["engines"]) != {e.id for e in config.engines}:
        return Verdict(False, "impossible values: engines do not match engine_set")
    for engine in config.engines:
        role = Role(doc["engines"][engine.id]["role"])
        if role not in KV_ROLE_PERMITS[engine.effective_kv_role]:
            return Verdict(
                False,
                f"impossible values: {engine.id} role {role.value} is not "
                f"permitted by kv_role {engine.effective_kv_role.value}",
            )
    return Verdict(
        True, f"applied handoff sequence {doc['sequence']} from {doc['writer']['router_id']}", doc
    )


def apply_document(doc: dict[str, Any], fleet: Fleet, clock: Clock) -> None:
    """Restore engine state; hold deadlines that passed meanwhile are treated as passed."""
    now_mono, now_wall = clock.monotonic(), clock.wall()
    for engine_id, saved in doc["engines"].items():
        engine = fleet.get(engine_id)
        engine.role = Role(saved["role"])
        engine.generation = saved["generation"]
        ej = saved["ejection"]
        engine.ejected = (
            Ejection(ej["cause"], ej["reason"], ej["at"], dict(ej["evidence"])) if ej else None
        )
        engine.holds.clear()
        for h in saved["holds"]:
            deadline = h["deadline"]
            if deadline is not None and deadline <= now_wall:
                continue
            engine.holds[HoldName(h["name"])] = Hold(
                HoldName(h["name"]),
                h["reason"],
                h["since"],
                deadline_mono=None if deadline is None else now_mono + (deadline - now_wall),
                deadline_wall=deadline,
            )
        if saved["inference_verification"]:
            v = saved["inference_verification"]
            engine.holds[HoldName.INFERENCE_VERIFICATION] = Hold(
                HoldName.INFERENCE_VERIFICATION, v["reason"], v["since"]
            )
    fleet.counters.restore(doc["counters"])


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
    ) -> None:
        self.path = path
        self._router_id = router_id
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
        await asyncio.to_thread(atomic_write, self.path, data, 0o600, self._fs)

    def accept(self, doc: dict[str, Any]) -> None:
        self.sequence = doc["sequence"]
        self.last_document = doc
        self.writes += 1

    async def stage(self, now: float) -> None:
        doc = self.document()
        # A sequence number is consumed even if the write fails part-way (e.g. the directory
        # fsync after the rename): a number that may be on disk is never reused.
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
