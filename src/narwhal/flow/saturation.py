"""When an engine is full, and when a role still has room (DESIGN §13). Pure.

An engine is full when Narwhal's in-flight on it reaches `engines[].max_concurrency`, its own
queue (`vllm:num_requests_waiting`) exceeds `flow.engine_waiting_max`, or its KV cache
(`vllm:kv_cache_usage_perc`) exceeds `flow.engine_kv_usage_max`. A scrape that is missing or
stale says nothing: the engine is then judged on Narwhal's own count alone, never guessed.
A request starts only when both of its roles have room, so a waiting request never holds KV
blocks on a prefill engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol, TypeVar

from narwhal.config import FlowConfig
from narwhal.placement.load import EngineLoad


class Full(StrEnum):
    """Why an engine is full (the first that holds, in this order)."""

    CONCURRENCY = "max_concurrency"
    WAITING = "engine_waiting"
    KV_USAGE = "engine_kv_usage"


@dataclass(frozen=True, slots=True)
class FlowLimits:
    """The fleet-wide limits (`flow.engine_waiting_max`, `flow.engine_kv_usage_max`)."""

    engine_waiting_max: int = 8
    engine_kv_usage_max: float = 0.95

    @classmethod
    def of(cls, flow: FlowConfig) -> FlowLimits:
        return cls(flow.engine_waiting_max, flow.engine_kv_usage_max)


@dataclass(frozen=True, slots=True)
class EngineView:
    """One eligible engine as flow control sees it: Narwhal's in-flight on it (all workers),
    its own limit, and its last fresh scrape (None: none)."""

    id: str
    in_flight: int
    max_concurrency: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None

    @classmethod
    def of(
        cls,
        engine_id: str,
        in_flight: int,
        max_concurrency: int | None,
        load: EngineLoad | None,
        now: float,
        stale_s: float,
    ) -> EngineView:
        """The view at `now`: a scrape older than `stale_s` (`placement.metrics_stale_s`)
        is dropped."""
        if load is None or not load.fresh(now, stale_s):
            return cls(engine_id, in_flight, max_concurrency)
        return cls(engine_id, in_flight, max_concurrency, load.waiting, load.kv_usage)


def full_reason(engine: EngineView, limits: FlowLimits) -> Full | None:
    """Why `engine` is full, or None when it has room."""
    if engine.max_concurrency is not None and engine.in_flight >= engine.max_concurrency:
        return Full.CONCURRENCY
    if engine.waiting is not None and engine.waiting > limits.engine_waiting_max:
        return Full.WAITING
    if engine.kv_usage is not None and engine.kv_usage > limits.engine_kv_usage_max:
        return Full.KV_USAGE
    return None


def freed_by_one(engine: EngineView, limits: FlowLimits) -> bool:
    """Whether one request fewer of Narwhal's on `engine` would give it room: it is full by
    its `max_concurrency` alone (a stream that leaves an engine full by its own queue or KV
    cache frees nothing another request could use)."""
    if engine.max_concurrency is None or engine.in_flight < engine.max_concurrency:
        return False
    return full_reason(replace(engine, in_flight=engine.max_concurrency - 1), limits) is None


def engine_full(engine: EngineView, limits: FlowLimits) -> bool:
    return full_reason(engine, limits) is not None


def role_has_room(engines: Iterable[EngineView], limits: FlowLimits) -> bool:
    """Whether any of a role's eligible engines has room (none eligible: no room; that
    request is the data plane's `no capacity`, not a wait)."""
    return any(full_reason(e, limits) is None for e in engines)


def can_start(
    prefill: Iterable[EngineView], decode: Iterable[EngineView], limits: FlowLimits
) -> bool:
    """Whether a request may start now: both of its roles have room. A unified (`both`)
    fleet passes its engines as both roles."""
    return role_has_room(prefill, limits) and role_has_room(decode, limits)


class Counted(Protocol):
    """An engine with Narwhal's in-flight count on it (a placement candidate)."""

    @property
    def id(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


C = TypeVar("C", bound=Counted)


def below_limits(
    candidates: Sequence[C],
    max_concurrency: Callable[[str], int | None],
    loads: Mapping[str, EngineLoad],
    now: float,
    stale_s: float,
    limits: FlowLimits,
) -> tuple[list[C], bool]:
    """With flow control off, at placement: the candidates below their `max_concurrency` (a
    bound never passed), and whether any of them has room by the whole measure
    (`full_reason`: also the last fresh scrape of its queue and KV usage). An engine full by
    its scrape alone may still be placed on beside others with room: the ranking weighs its
    queue."""
    below: list[C] = []
    room = False
    for c in candidates:
        limit = max_concurrency(c.id)
        if limit is not None and c.in_flight >= limit:
            continue
        below.append(c)
        if not room:
            load = loads.get(c.id)
            room = load is None or (
                full_reason(EngineView.of(c.id, c.in_flight, limit, load, now, stale_s), limits)
                is None
            )
    return below, room
