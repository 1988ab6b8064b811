"""The soak's fault schedule: a pure function of a seeded RNG, bounded in count and time.

Every event starts at `t` (seconds into the run) and is undone `duration_s` later (a killed
engine restarted, a frozen one thawed, a fault cleared, the handoff directory put back, a
drained engine readmitted, an engine under maintenance restarted). At most one event holds an
engine at a time and every role keeps at least one engine untouched, so that the fleet can always
serve; router events never overlap one another.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

# kind -> (weight, min duration, max duration); engine faults first, router-only ones last
ENGINE_KINDS: dict[str, tuple[int, float, float]] = {
    "engine_kill": (3, 2.0, 5.0),
    "engine_freeze": (3, 1.5, 4.0),
    "burst_5xx": (3, 1.0, 3.0),
    "handoff_garbage": (2, 1.0, 3.0),
    "handoff_missing": (1, 1.0, 3.0),
    "stall_first_token": (2, 1.0, 3.0),
    "stall_mid_stream": (2, 1.0, 3.0),
    "no_done": (2, 1.0, 3.0),
}
ROUTER_KINDS: dict[str, tuple[int, float, float]] = {
    "drain": (3, 3.0, 8.0),
    "maintenance": (2, 3.0, 6.0),
    "handoff_dir": (2, 0.6, 1.2),
    "router_kill": (2, 0.0, 0.0),
}
ROUTER_ONLY = frozenset(ROUTER_KINDS)
PREFILL_ONLY = frozenset({"handoff_garbage", "handoff_missing"})
DECODE_ONLY = frozenset({"stall_mid_stream", "no_done"})
ENGINELESS = frozenset({"handoff_dir", "router_kill"})
ROUTER_KILL_GAP_S = 20.0  # between two router kills: the restarted one must become standby
ROUTER_QUIET_S = 3.0  # no router kill this soon after an operator action or a handoff fault


@dataclass(frozen=True, slots=True)
class Event:
    t: float
    kind: str
    engine: str | None  # None for router events
    duration_s: float

    @property
    def end(self) -> float:
        return self.t + self.duration_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan(
    rng: random.Random,
    duration_s: float,
    engines: dict[str, str],  # name -> role
    router_faults: bool,
    gap_s: tuple[float, float] = (1.0, 3.0),
    lead_s: float = 3.0,
    tail_s: float = 4.0,
) -> list[Event]:
    """Events from `lead_s` until `duration_s - tail_s` (everything undone by then)."""
    kinds = dict(ENGINE_KINDS)
    if router_faults:
        kinds |= ROUTER_KINDS
    names = sorted(kinds)
    weights = [kinds[k][0] for k in names]
    busy: dict[str, float] = {}  # engine -> when its current event ends
    router_busy = 0.0
    last_kill = -ROUTER_KILL_GAP_S
    last_operator = -ROUTER_QUIET_S
    events: list[Event] = []
    t = lead_s
    stop = duration_s - tail_s
    while True:
        t += rng.uniform(*gap_s)
        kind = rng.choices(names, weights)[0]
        lo, hi = kinds[kind][1:]
        length = round(rng.uniform(lo, hi), 2)
        if t + length > stop:
            break
        if kind in ENGINELESS:
            if t < router_busy:
                continue
            if kind == "router_kill" and (
                t - last_kill < ROUTER_KILL_GAP_S or t - last_operator < ROUTER_QUIET_S
            ):
                continue
            events.append(Event(round(t, 2), kind, None, length))
            router_busy = t + max(length, ROUTER_QUIET_S)
            if kind == "router_kill":
                last_kill = t
            else:
                last_operator = t
            continue
        target = _pick(rng, kind, t, engines, busy)
        if target is None:
            continue
        busy[target] = t + length
        if kind in ("drain", "maintenance"):
            last_operator = t
        events.append(Event(round(t, 2), kind, target, length))
    return events


def _pick(
    rng: random.Random, kind: str, t: float, engines: dict[str, str], busy: dict[str, float]
) -> str | None:
    """A free engine of a role that keeps another free engine, or None."""
    roles = {"prefill", "decode"}
    if kind in PREFILL_ONLY:
        roles = {"prefill"}
    elif kind in DECODE_ONLY:
        roles = {"decode"}
    free = [n for n in sorted(engines) if busy.get(n, 0.0) <= t]
    options = [
        n
        for n in free
        if engines[n] in roles and sum(1 for m in free if engines[m] == engines[n]) >= 2
    ]
    return rng.choice(options) if options else None
