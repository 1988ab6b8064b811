"""The admin API's documents as pure functions of a snapshot.

What `/admin/engines`, `/admin/stats`, `/admin/flow`, `/admin/dashboard`, `/admin/handoff`,
`/admin/lease` and `/admin/workers` answer is decided here, from an `AdminSnapshot` the router
takes in one go (`Router.admin_snapshot`, or the smaller snapshot a view needs); the handlers in
`http_routes.py` only take it and send the result.
So each document can be tested from plain values, and no view reads a clock or a live object
of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from narwhal.engine.failures import FailureClass
from narwhal.fleet.intervals import Window
from narwhal.fleet.state import EngineState


@dataclass(frozen=True, slots=True)
class EngineRow:
    """One engine as the fleet sees it now."""

    state: EngineState
    eligible: bool
    in_flight: int
    drain_settled_at: float | None  # wall clock
    readmission: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """The interval windows and the small-fleet stages' findings."""

    interval_s: float
    current: Window
    closed: tuple[Window, ...]
    windows_kept: int | None
    drift: tuple[tuple[str, str], ...]  # (engine id, reason)
    drift_mode: str
    risk: Mapping[str, dict[str, Any]]
    rebalances: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class PlacementSnapshot:
    """Cache-aware placement at a glance: the policy, each engine's entries in this
    process's index, and per model and per prefill engine chosen the prompt tokens looked up
    and found cached."""

    policy: str
    cached_blocks: Mapping[str, int]
    lookup_tokens: Mapping[str, float]
    hit_tokens: Mapping[str, float]
    engine_lookup_tokens: Mapping[str, float] = field(default_factory=dict)
    engine_hit_tokens: Mapping[str, float] = field(default_factory=dict)


def _hit_rates(looked: Mapping[str, float], hits: Mapping[str, float]) -> dict[str, Any]:
    return {
        name: {
            "lookup_tokens": n,
            "hit_tokens": hits.get(name, 0.0),
            "hit_rate": hits.get(name, 0.0) / n if n else None,
        }
        for name, n in sorted(looked.items())
    }


def placement(p: PlacementSnapshot) -> dict[str, Any]:
    """The `placement` part of `/admin/engines` and the dashboard."""
    return {
        "policy": p.policy,
        "cached_blocks": dict(p.cached_blocks),
        "models": _hit_rates(p.lookup_tokens, p.hit_tokens),
        "engines": _hit_rates(p.engine_lookup_tokens, p.engine_hit_tokens),
    }


@dataclass(frozen=True, slots=True)
class FlowSnapshot:
    """Flow control's queue and refusals as the control process holds them (DESIGN §13):
    each waiting request's `(priority, enqueued_at)` on the monotonic clock, and counts
    since the router started."""

    enabled: bool  # the queue orders requests (`Config.flow_on`)
    rate_limits: bool  # some key's policy sets a rate limit
    queue_limit: int
    max_wait_s: float
    mono: float  # the monotonic clock when taken
    waiting: tuple[tuple[int, float], ...]
    running: int  # started through flow control, not ended (and not stepped aside)
    refused: Mapping[str, int]  # by reason: a `ShedReason` value, or `not_admitted` (503)
    refused_by_key: Mapping[str, Mapping[str, int]]  # key label -> reason -> count
    served_tokens: Mapping[str, int]  # output tokens by key label
    resuming: int = 0  # streams that stepped aside (preemption), waiting to go on
    preempted: Mapping[int, int] = field(default_factory=dict)  # streams asked, by priority


def flow(f: FlowSnapshot) -> dict[str, Any]:
    """`GET /admin/flow` and the dashboard's queue panel: depth and oldest wait by priority
    (lowest number first, as they start), and refusals by reason and, for rate limits, by
    key."""
    by_priority: dict[int, tuple[int, float]] = {}
    for priority, enqueued_at in f.waiting:
        count, oldest = by_priority.get(priority, (0, enqueued_at))
        by_priority[priority] = (count + 1, min(oldest, enqueued_at))
    priorities = [
        {"priority": p, "waiting": n, "oldest_wait_s": max(0.0, f.mono - oldest)}
        for p, (n, oldest) in sorted(by_priority.items())
    ]
    return {
        "enabled": f.enabled,
        "rate_limits": f.rate_limits,
        "queue_limit": f.queue_limit,
        "max_wait_s": f.max_wait_s,
        "waiting": len(f.waiting),
        "running": f.running,
        "resuming": f.resuming,
        "oldest_wait_s": max((p["oldest_wait_s"] for p in priorities), default=None),
        "priorities": priorities,
        "refused": dict(sorted(f.refused.items())),
        "refused_by_key": {k: dict(sorted(v.items())) for k, v in sorted(f.refused_by_key.items())},
        "served_tokens": dict(sorted(f.served_tokens.items())),
        "preempted": {str(p): n for p, n in sorted(f.preempted.items())},
    }


@dataclass(frozen=True, slots=True)
class AdminSnapshot:
    router_id: str
    ready: str | None  # why /ready answers 503 (its message); None: ready
    mono: float  # the monotonic clock when taken
    wall: float  # the wall clock at the same moment
    engines: tuple[EngineRow, ...]
    stats: StatsSnapshot
    monitor: dict[str, Any]
    lease: dict[str, Any] | None  # None: no lease backend
    timeline: tuple[dict[str, Any], ...]
    placement: PlacementSnapshot | None = None
    flow: FlowSnapshot | None = None


def engine(row: EngineRow, now: float) -> dict[str, Any]:
    """One entry of `/admin/engines` (`now`: the monotonic clock)."""
    e = row.state
    holds = e.active_holds(now)
    return {
        "id": e.id,
        "url": e.config.url,
        "role": e.role.value,
        "kv_role": e.config.effective_kv_role.value,
        "model": e.model,
        "served_models": sorted(e.served),
        "eligible": row.eligible,
        "verified": e.verified,
        "unverified_reason": e.unverified_reason,
        "ejected": e.ejected is not None,
        "ejection": e.ejected.admin_json() if e.ejected else None,
        "holds": [h.name.value for h in holds],
        "hold_details": [
            {
                "name": h.name.value,
                "reason": h.reason,
                "since": h.since_wall,
                "deadline": h.deadline_wall,
            }
            for h in holds
        ],
        "evidence": {c.value: e.evidence.get(c, 0) for c in FailureClass},
        "liveness_misses": e.liveness_misses,
        "in_flight": row.in_flight,
        "generation": e.generation,
        "max_model_len": e.max_model_len,
        "drain_settled": row.drain_settled_at is not None,
        "drain_settled_at": row.drain_settled_at,
        "readmission": list(row.readmission),
    }


def engines(snap: AdminSnapshot) -> list[dict[str, Any]]:
    return [engine(row, snap.mono) for row in snap.engines]


def engines_document(snap: AdminSnapshot) -> dict[str, Any]:
    """`GET /admin/engines`."""
    doc = {"engines": engines(snap), "consolidation_risk": dict(snap.stats.risk)}
    if snap.placement is not None:
        doc["placement"] = placement(snap.placement)
    return doc


def _window(w: Window) -> dict[str, dict[str, Any]]:
    return {e: x.to_json() for e, x in w.engines.items()}


def stats(s: StatsSnapshot) -> dict[str, Any]:
    """`GET /admin/stats`: the open window and the closed ones (monotonic starts)."""
    return {
        "interval_s": s.interval_s,
        "current": _window(s.current),
        "closed": [{"started": w.started, "engines": _window(w)} for w in s.closed],
        "drift": [{"engine": engine_id, "reason": reason} for engine_id, reason in s.drift],
        "drift_mode": s.drift_mode,
        "consolidation_risk": dict(s.risk),
        "rebalances": list(s.rebalances),
    }


def engine_history(s: StatsSnapshot, mono: float, wall: float) -> dict[str, Any]:
    """The dashboard's sparklines: the kept windows then the open one, with wall-clock
    bounds (each ends where the next starts; the open one ends now)."""
    windows = [*s.closed, s.current]
    ends = [w.started for w in windows[1:]] + [mono]
    return {
        "interval_s": s.interval_s,
        "windows_kept": s.windows_kept,
        "windows": [
            {
                "started": wall - (mono - w.started),
                "ended": wall - (mono - end),
                "open": w is s.current,
                "engines": _window(w),
            }
            for w, end in zip(windows, ends, strict=True)
        ],
    }


def lease(held: dict[str, Any] | None, router_id: str, with_router_id: bool) -> dict[str, Any]:
    """`GET /admin/lease` (`with_router_id`) and the dashboard's lease, from the lease's own
    document (None: no lease backend, so this router is simply active)."""
    if held is not None:
        return held
    alone: dict[str, Any] = {"backend": "none", "role": "active"}
    return {**alone, "router_id": router_id} if with_router_id else alone


def dashboard(snap: AdminSnapshot) -> dict[str, Any]:
    """`GET /admin/dashboard`: everything the dashboard page draws, in one document."""
    return {
        "router_id": snap.router_id,
        "ready": snap.ready,
        "engines": engines(snap),
        "monitor": snap.monitor,
        "lease": lease(snap.lease, snap.router_id, with_router_id=False),
        "timeline": list(snap.timeline),
        "now": snap.wall,
        "engine_history": engine_history(snap.stats, snap.mono, snap.wall),
        "placement": None if snap.placement is None else placement(snap.placement),
        "flow": None if snap.flow is None else flow(snap.flow),
    }


def handoff(
    path: str,
    sequence: int,
    document: dict[str, Any] | None,
    verdict: tuple[bool, str, str | None] | None,
) -> dict[str, Any]:
    """`GET /admin/handoff`: the last document written (or followed) and the resume's
    verdict, `(applied, reason, code)`."""
    resume = None
    if verdict is not None:
        applied, reason, code = verdict
        resume = {"applied": applied, "reason": reason, "code": code}
    return {"path": path, "sequence": sequence, "document": document, "resume": resume}


def workers(
    supervised: list[dict[str, Any]] | None, pid: int, snapshot_version: int | None
) -> dict[str, Any]:
    """`GET /admin/workers`: the data-plane processes; this one alone without workers."""
    if supervised is None:
        return {"workers": [{"index": 0, "pid": pid, "running": True}], "control": None}
    return {"workers": supervised, "control": {"pid": pid, "snapshot_version": snapshot_version}}
