"""The soak's invariants, each a pure function over what the run observed, returning a count
of violations (and, where useful, the violations themselves for the report).

Times are CLOCK_MONOTONIC seconds, shared by every process on the machine (the load generator,
the tap and the orchestrator read the same clock).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.soak.badreq import ENGINE_JUDGED, BadAnswer

SOFT_HOLDS = ("failure_quarantine", "performance_drift")  # last-engine protection may place


def blocked(status: str) -> bool:
    """Whether a transition log status (`in-service`, `ejected`, `held(a,b)`, ...) keeps
    client requests away. Soft holds alone do not: last-engine protection may place there."""
    if status == "in-service":
        return False
    if status.startswith("held(") and status.endswith(")"):
        holds = [h for h in status[5:-1].split(",") if h]
        return any(h not in SOFT_HOLDS for h in holds)
    return True  # ejected, unverified, anything else that is not in service


def hung(records: Iterable[Sequence[object]], deadline_s: float) -> int:
    """Requests the client gave up on, or that took longer than `deadline_s`.

    A record is the load generator's (start, end, outcome, streamed, midstream)."""
    count = 0
    for r in records:
        t0, t1, outcome = float(r[0]), float(r[1]), r[2]  # type: ignore[arg-type]
        if outcome == "hung" or t1 - t0 > deadline_s:
            count += 1
    return count


def client_error_5xx(answers: Iterable[BadAnswer]) -> int:
    """Malformed or over-long requests (t, kind, status, message) that got a 5xx (or no
    answer) because of what they are. Not counted: a 503 that every request gets in that
    state (`FLEET_STATE_503`: not admitting, no capacity, no verified engine yet) to a request
    only the engines can judge (`ENGINE_JUDGED`). A malformed body is judged without
    engines, so any 5xx to it counts."""
    return sum(
        1
        for _, kind, status, message in answers
        if status is None
        or (
            status >= 500
            and not (
                status == 503 and kind in ENGINE_JUDGED and message.startswith(FLEET_STATE_503)
            )
        )
    )


FLEET_STATE_503 = ("not admitting requests", "no capacity:", "starting:")


@dataclass(frozen=True, slots=True)
class Transition:
    t: float
    engine: str
    status: str  # the status it moved to


@dataclass(frozen=True, slots=True)
class Misplaced:
    engine: str
    at: float  # when the leg reached the engine
    router: str
    blocked_since: float  # when that router's log last showed it blocked
    status: str
    request_id: str | None = None  # the leg's X-Request-Id, when the tap saw it
    placed_by: str = "ready"  # how `router` was told: its request id, or /ready polls


def active_changes(
    samples: Iterable[tuple[float, int | None, int | None]],
) -> list[tuple[float, str]]:
    """From /ready polls (t, status of a, status of b): when each router became the one
    answering 200 (`a` or `b`)."""
    out: list[tuple[float, str]] = []
    for t, a, b in samples:
        now = "a" if a == 200 and b != 200 else "b" if b == 200 and a != 200 else None
        if now is not None and (not out or out[-1][1] != now):
            out.append((t, now))
    return out


def placer(request_id: str | None, prefixes: dict[str, str]) -> str | None:
    """The router whose process made `request_id` (`<prefix>-N-aK`), from the request-id
    prefixes each router logged as its processes started; None when unknown."""
    if request_id is None:
        return None
    for prefix, router in prefixes.items():
        if request_id.startswith(prefix + "-"):
            return router
    return None


def misplaced(
    arrivals: dict[str, list[float]],
    timelines: dict[str, list[Transition]],
    active: list[tuple[float, str]],
    tolerance_s: float,
    ids: dict[str, list[str | None]] | None = None,
    prefixes: dict[str, str] | None = None,
) -> list[Misplaced]:
    """Legs that reached an engine which the placing router had shown blocked for at least
    `tolerance_s` without a break. The placing router is the one whose process made the
    leg's request id (`ids`, `prefixes`), else the last one seen answering /ready 200 at or
    before the arrival. An engine with no transition yet counts as placeable."""
    starts = [t for t, _ in active]
    by_engine: dict[tuple[str, str], list[Transition]] = {}
    for router, log in timelines.items():
        for tr in sorted(log, key=lambda x: x.t):
            by_engine.setdefault((router, tr.engine), []).append(tr)
    out: list[Misplaced] = []
    for engine, times in arrivals.items():
        engine_ids = (ids or {}).get(engine) or [None] * len(times)
        for at, request_id in zip(times, engine_ids, strict=True):
            router = placer(request_id, prefixes or {})
            by = "request id"
            if router is None:
                i = bisect.bisect_right(starts, at) - 1
                if i < 0:
                    continue
                router, by = active[i][1], "ready"
            log = by_engine.get((router, engine), [])
            ts = [tr.t for tr in log]
            j = bisect.bisect_right(ts, at) - 1  # the last change at or before the arrival
            if j < 0 or not blocked(log[j].status):
                continue
            since = log[j].t
            k = j
            while k > 0 and blocked(log[k - 1].status):
                since = log[k - 1].t
                k -= 1
            if at - since > tolerance_s:
                out.append(Misplaced(engine, at, router, since, log[j].status, request_id, by))
    return out


def handoff_unparseable(samples: Iterable[tuple[float, str]]) -> int:
    """Polls of the handoff file (t, `ok` | `unparseable` | `missing` | `away`): an
    unparseable document, or a missing one once it existed and while its directory was in
    place (`away`: the soak itself had moved the directory)."""
    seen = False
    count = 0
    for _, state in samples:
        if state == "ok":
            seen = True
        elif state == "unparseable" or (state == "missing" and seen):
            count += 1
    return count


def split_brain(samples: Iterable[tuple[float, int | None, int | None]]) -> int:
    """Polls in which both routers answered /ready 200."""
    return sum(1 for _, a, b in samples if a == 200 and b == 200)


def drains_lost(checks: Iterable[tuple[float, str, bool]]) -> int:
    """After a takeover, per operator-drained engine (t, engine, still drained?)."""
    return sum(1 for _, _, held in checks if not held)


@dataclass(frozen=True, slots=True)
class Stint:
    """One router process's time as the active: fds and RSS (KiB) early and late in it."""

    router: str
    pid: int
    fds: tuple[int, int]
    rss_kb: tuple[int, int]
    span_s: float


def growth(stints: Iterable[Stint], fd_tolerance: int, rss_tolerance_kb: int) -> list[Stint]:
    """Stints whose fd count or RSS grew by more than the tolerance from start to end."""
    return [
        s
        for s in stints
        if s.fds[1] - s.fds[0] > fd_tolerance or s.rss_kb[1] - s.rss_kb[0] > rss_tolerance_kb
    ]
