"""Fault injection: what a fault is, and the book that decides when one fires.

A fault names a kind, the legs it targets, and optionally how often it fires (`count`) and with
what chance (`probability`, drawn from an injected RNG). Request handlers ask the book
`fire(kind, leg)` at the point the fault would act; the book answers with the fault or None.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from narwhal.sim.leg import Leg


class FaultKind(StrEnum):
    REFUSE_CONNECTIONS = "refuse_connections"
    RESET_CONNECTIONS = "reset_connections"
    HEALTH_HANG = "health_hang"
    HEALTH_STATUS = "health_status"
    METRICS_HANG = "metrics_hang"
    COMPLETION_STATUS = "completion_status"
    STALL_FIRST_TOKEN = "stall_first_token"
    STALL_MID_STREAM = "stall_mid_stream"
    NO_DONE = "no_done"
    MALFORMED_EVENT = "malformed_event"
    ERROR_EVENT = "error_event"
    HANDOFF_GARBAGE = "handoff_garbage"
    HANDOFF_MISSING = "handoff_missing"
    WRONG_MODEL = "wrong_model"
    RESTART = "restart"
    SLOW = "slow"
    KV_EVENTS_DROP = "kv_events_drop"  # a KV-event message is not sent (its number is spent)
    KV_EVENTS_SILENT = "kv_events_silent"  # no KV-event message, no replay answer
    KV_EVENTS_RESTART = "kv_events_restart"  # the KV-event sequence starts again at 0


# Server-level actions that happen once, when the fault is added, instead of being kept.
IMMEDIATE = frozenset(
    {FaultKind.REFUSE_CONNECTIONS, FaultKind.RESTART, FaultKind.KV_EVENTS_RESTART}
)

_PARAMS = ("duration_s", "delay_s", "status", "after_tokens", "model", "factor")
_ALLOWED: dict[FaultKind, frozenset[str]] = {
    FaultKind.REFUSE_CONNECTIONS: frozenset({"duration_s"}),
    FaultKind.HEALTH_HANG: frozenset({"delay_s"}),
    FaultKind.METRICS_HANG: frozenset({"delay_s"}),
    FaultKind.HEALTH_STATUS: frozenset({"status"}),
    FaultKind.COMPLETION_STATUS: frozenset({"status"}),
    FaultKind.STALL_FIRST_TOKEN: frozenset({"delay_s"}),
    FaultKind.STALL_MID_STREAM: frozenset({"after_tokens", "delay_s"}),
    FaultKind.MALFORMED_EVENT: frozenset({"after_tokens"}),
    FaultKind.ERROR_EVENT: frozenset({"after_tokens"}),
    FaultKind.WRONG_MODEL: frozenset({"model"}),
    FaultKind.SLOW: frozenset({"factor"}),
}
_REQUIRED: dict[FaultKind, frozenset[str]] = {
    FaultKind.HEALTH_STATUS: frozenset({"status"}),
    FaultKind.COMPLETION_STATUS: frozenset({"status"}),
    FaultKind.WRONG_MODEL: frozenset({"model"}),
    FaultKind.SLOW: frozenset({"factor"}),
}


class FaultSpec(BaseModel):
    """One fault as the API and `--fault` take it; parameters only where the kind uses them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FaultKind
    leg: Leg | None = Field(default=None, description="null or 'any': every leg")
    count: int | None = Field(default=None, ge=1)
    probability: float | None = Field(default=None, ge=0.0, le=1.0)
    duration_s: float | None = Field(default=None, ge=0.0)  # None: until the process restarts
    delay_s: float | None = Field(default=None, ge=0.0)  # None: forever
    status: int | None = Field(default=None, ge=100, le=599)
    after_tokens: int | None = Field(default=None, ge=0)  # default 1
    model: str | None = None
    factor: float | None = Field(default=None, gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _any_leg(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("leg") == "any":
            return {**data, "leg": None}
        return data

    @model_validator(mode="after")
    def _params_fit_kind(self) -> Self:
        allowed = _ALLOWED.get(self.kind, frozenset())
        given = {p for p in _PARAMS if p in self.model_fields_set}
        if stray := sorted(given - allowed):
            raise ValueError(f"{', '.join(stray)} does not apply to {self.kind.value}")
        if missing := sorted(_REQUIRED.get(self.kind, frozenset()) - given):
            raise ValueError(f"{self.kind.value} needs {', '.join(missing)}")
        return self

    def to_json(self) -> dict[str, Any]:
        params = {p: getattr(self, p) for p in sorted(_ALLOWED.get(self.kind, frozenset()))}
        return {
            "kind": self.kind.value,
            "leg": self.leg.value if self.leg else "any",
            "count": self.count,
            "probability": self.probability,
            **params,
        }


class Fault:
    """A fault in the book: its spec, its id, and how often it has fired."""

    __slots__ = ("fired", "id", "spec")

    def __init__(self, fault_id: int, spec: FaultSpec) -> None:
        self.id = fault_id
        self.spec = spec
        self.fired = 0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, **self.spec.to_json(), "fired": self.fired}


class FaultBook:
    """The active faults. `fire` is on every request's path, so a kind with none is one lookup."""

    def __init__(self, rng: random.Random, on_fire: Callable[[FaultKind], None]) -> None:
        self._rng = rng
        self._on_fire = on_fire
        self._next_id = 1
        self._by_kind: dict[FaultKind, list[Fault]] = {}

    def new(self, spec: FaultSpec) -> Fault:
        """A numbered fault not (yet) in the book: immediate kinds are recorded fired, not kept."""
        fault = Fault(self._next_id, spec)
        self._next_id += 1
        return fault

    def add(self, spec: FaultSpec) -> Fault:
        fault = self.new(spec)
        self._by_kind.setdefault(spec.kind, []).append(fault)
        return fault

    def record_fired(self, fault: Fault) -> None:
        fault.fired += 1
        self._on_fire(fault.spec.kind)

    def snapshot(self) -> list[Fault]:
        return sorted((f for fs in self._by_kind.values() for f in fs), key=lambda f: f.id)

    def remove(self, fault_id: int) -> bool:
        for faults in self._by_kind.values():
            for fault in faults:
                if fault.id == fault_id:
                    faults.remove(fault)
                    return True
        return False

    def clear(self) -> None:
        self._by_kind.clear()

    def fire(self, kind: FaultKind, leg: Leg | None = None) -> Fault | None:
        """The first fault of `kind` that fires now for `leg` (None: not a completion, any leg).

        A fault fires when it targets the leg, has firings left, and wins its probability draw.
        """
        faults = self._by_kind.get(kind)
        if not faults:
            return None
        for fault in faults:
            spec = fault.spec
            if leg is not None and spec.leg is not None and spec.leg is not leg:
                continue
            if spec.count is not None and fault.fired >= spec.count:
                continue
            if spec.probability is not None and self._rng.random() >= spec.probability:
                continue
            self.record_fired(fault)
            return fault
        return None
