"""What a worker tells the control process, as typed events with one codec (as
`fleet/codec.py` is for engine state): a leg's failure keeps its shape, class, detail, status
and whether a deadline ran out, from the leg that saw it to the reducer that judges it.

On the wire each event is one channel frame (`process/channel.py`): its kind in `t`, its fields
by name, enums as their values. `decode` refuses a frame it cannot read whole (`FrameError`):
the control process logs it and goes on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from narwhal.engine.failures import EngineFailure, FailureClass, SuccessKind
from narwhal.flow.messages import (
    Ask,
    Begun,
    Done,
    FlowEffect,
    Kept,
    Preempt,
    Refuse,
    Requeue,
    Start,
    Withdraw,
)


class FrameError(ValueError):
    """A worker's frame that is not a well-formed event."""


@dataclass(frozen=True, slots=True)
class LegFailed:
    """A leg's classified failure (`seq`: the worker's count, acknowledged back)."""

    seq: int
    engine: str
    leg: str
    failure_class: FailureClass
    detail: str
    status: int | None = None
    timed_out: bool = False

    @classmethod
    def of(cls, seq: int, engine: str, leg: str, failure: EngineFailure) -> LegFailed:
        return cls(
            seq, engine, leg, failure.failure_class, failure.detail, failure.status,
            failure.timed_out,
        )  # fmt: skip

    def failure(self) -> EngineFailure:
        return EngineFailure(
            self.failure_class, self.detail, status=self.status, timed_out=self.timed_out
        )


@dataclass(frozen=True, slots=True)
class LegSucceeded:
    seq: int
    engine: str
    leg: str
    success: SuccessKind


@dataclass(frozen=True, slots=True)
class Noted:
    """An event for the control process's timeline (a migration)."""

    event: str
    engine: str | None
    what: str


@dataclass(frozen=True, slots=True)
class Placed:
    """A prefill placed with these block keys (cache-aware placement, DESIGN §11)."""

    model: str
    engine: str
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Seen:
    """The worker applied the fleet snapshot of this version."""

    version: int


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker listens."""

    pid: int


@dataclass(frozen=True, slots=True)
class Stats:
    """Per engine: requests, latency and inter-token samples; the timeline's counts."""

    engines: Mapping[str, Any]
    timeline: tuple[Any, ...]


WorkerEvent = (
    LegFailed
    | LegSucceeded
    | Noted
    | Placed
    | Seen
    | Ready
    | Stats
    | Ask
    | Begun
    | Done
    | Withdraw
    | Requeue
    | Kept
)

KINDS: dict[type[Any], str] = {
    LegFailed: "failed",
    LegSucceeded: "succeeded",
    Noted: "note",
    Placed: "placed",
    Seen: "seen",
    Ready: "ready",
    Stats: "stats",
    # Flow control (DESIGN §13, flow/messages.py): a request asks to start, its legs are placed,
    # it ends, or its client left while it waited; a preempted stream waits to go on, or
    # could not step aside.
    Ask: "ask",
    Begun: "begun",
    Done: "done",
    Withdraw: "withdraw",
    Requeue: "requeue",
    Kept: "kept",
}
_BY_KIND = {kind: cls for cls, kind in KINDS.items()}


def encode(event: WorkerEvent) -> tuple[str, dict[str, Any]]:
    """The frame's kind and fields."""
    fields: dict[str, Any] = {}
    for name in event.__slots__:
        value = getattr(event, name)
        fields[name] = value.value if isinstance(value, FailureClass | SuccessKind) else value
    return KINDS[type(event)], fields


def decode(frame: Mapping[str, Any]) -> WorkerEvent:
    """The event a frame carries; FrameError when it carries none whole."""
    kind = frame.get("t")
    cls = _BY_KIND.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise FrameError(f"unknown frame kind {kind!r}")
    try:
        fields = {name: frame[name] for name in cls.__slots__}
    except KeyError as exc:
        raise FrameError(f"{kind} frame without {exc.args[0]!r}") from None
    try:
        if cls is LegFailed:
            fields["failure_class"] = FailureClass(fields["failure_class"])
        elif cls is LegSucceeded:
            fields["success"] = SuccessKind(fields["success"])
        elif cls is Placed:
            fields["keys"] = tuple(int(k) for k in fields["keys"])
        elif cls is Stats:
            fields["timeline"] = tuple(fields["timeline"])
    except (ValueError, TypeError) as exc:
        raise FrameError(f"{kind} frame: {exc}") from None
    event: WorkerEvent = cls(**fields)
    return event


# ---------------------------------------------------------------- flow control's answers
def encode_answer(effect: FlowEffect) -> tuple[str, dict[str, Any]]:
    """A flow-control answer to a worker (`start` or `refuse`), or its request that a stream
    step aside (`preempt`), by its request id."""
    if isinstance(effect, Start):
        return "start", {"id": effect.id, "headers": dict(effect.headers)}
    if isinstance(effect, Preempt):
        return "preempt", {"id": effect.id, "priority": effect.priority}
    return "refuse", {
        "id": effect.id, "status": effect.status, "reason": effect.reason,
        "message": effect.message, "retry_after_s": effect.retry_after_s,
        "headers": dict(effect.headers), "priority": effect.priority,
    }  # fmt: skip


def decode_answer(frame: Mapping[str, Any], worker: int) -> FlowEffect:
    """What a `start`, `refuse` or `preempt` frame carries (FrameError when not whole)."""
    try:
        if frame["t"] == "start":
            return Start(frame["id"], worker, 0, 0.0, frame["headers"])
        if frame["t"] == "preempt":
            return Preempt(frame["id"], worker, int(frame["priority"]))
        return Refuse(
            frame["id"], worker, int(frame["status"]), frame["reason"], frame["message"],
            frame["retry_after_s"], frame["headers"], int(frame["priority"]),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"{frame.get('t')} frame: {exc!r}") from None
