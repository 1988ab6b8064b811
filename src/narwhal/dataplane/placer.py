"""Where each leg runs: the engine of a role, picked and counted in flight in one step.

Engines not yet tried by the request come first; with a prompt (cache-aware placement,
`prefix.py`) the engine holding most of its prefix against load, else the least loaded
(`placement.least_in_flight`). With flow control off, an engine that is full takes no new
leg, and a role whose every eligible engine is full is `Saturated` (DESIGN §13,
`flow.saturation`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from narwhal.clock import Clock
from narwhal.config import Config, Role
from narwhal.dataplane.outcomes import NoCapacity, Saturated
from narwhal.dataplane.placement import least_in_flight
from narwhal.dataplane.prefix import PrefixPlacement, Prompt
from narwhal.fleet.state import Candidate, EngineState
from narwhal.fleet.store import Fleet
from narwhal.flow.saturation import FlowLimits, below_limits
from narwhal.placement.index import PrefixMatch
from narwhal.telemetry.metrics import Children, DataMetrics


class Placer:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        clock: Clock,
        prefix: PrefixPlacement,
        metrics: DataMetrics,
    ) -> None:
        self._fleet = fleet
        self._counts = fleet.in_flight
        self._clock = clock
        self._prefix = prefix
        self._lookups = Children(metrics.prefix_lookup_tokens)
        self._hits = Children(metrics.prefix_hit_tokens)
        self._engine_lookups = Children(metrics.prefix_engine_lookup_tokens)
        self._engine_hits = Children(metrics.prefix_engine_hit_tokens)
        self.apply(config)

    def apply(self, config: Config) -> None:
        """What a config sets for new legs (at start, and on every reload). Flow control off:
        a full engine (DESIGN §13: its max_concurrency reached, or its scraped queue or KV
        usage past flow's bounds) takes no new request, and a role whose every eligible
        engine is full answers 503 at once (`bounded`: retried). With flow control on, its
        queue decided already."""
        self.refuse_full = not config.flow_on
        self._full_limits = FlowLimits.of(config.flow)
        self._stale_s = config.placement.metrics_stale_s

    def below_limits(self, candidates: list[Candidate], now: float) -> tuple[list[Candidate], bool]:
        """`flow.saturation.below_limits` over this process's fleet and scraped loads."""
        fleet = self._fleet
        return below_limits(
            candidates,
            lambda engine_id: fleet.get(engine_id).config.max_concurrency,
            self._prefix.loads, now, self._stale_s, self._full_limits,
        )  # fmt: skip

    @contextmanager
    def placed(
        self,
        role: Role,
        tried: set[str],
        model: str | None,
        prompt: Prompt | None = None,
        cached: Mapping[str, PrefixMatch] | None = None,
    ) -> Iterator[EngineState]:
        """An engine for `role`, in flight there until the block ends. The pick and its
        count are one step for every worker (`InFlightCounts.claim`). `cached`: the prompt's
        match in the index, looked up once per attempt for both legs, before the claim,
        whose lock every worker waits for (the decode's candidates gain nothing from what
        the prefill's placement added for a prefill engine)."""
        now = self._clock.monotonic()
        matched = 0
        full = False

        def choose(turn: int) -> str | None:
            nonlocal matched, full
            candidates = self._fleet.candidates(role, now, model)
            if self.refuse_full and candidates:
                candidates, room = self.below_limits(candidates, now)
                if not room:
                    full = True
                    return None
            if prompt is not None:
                ranked = self._prefix.choose(prompt, role, candidates, turn, tried, cached)
                if not ranked:
                    return None
                matched = ranked[0].matched_tokens
                return ranked[0].id
            return least_in_flight(candidates, turn, exclude=tried) or least_in_flight(
                candidates, turn
            )

        counts = self._counts
        engine_id = counts.claim(role.value, choose)
        if engine_id is None:
            if full:
                raise Saturated(f"every eligible {role.value} engine is full")
            raise NoCapacity(role, not self._fleet.has_verified(role, model))
        tried.add(engine_id)
        if prompt is not None:
            if role is not Role.DECODE:
                self._lookups(prompt.model).inc(prompt.tokens)
                self._hits(prompt.model).inc(matched)
                self._engine_lookups(engine_id).inc(prompt.tokens)
                self._engine_hits(engine_id).inc(matched)
            self._prefix.placed(prompt, engine_id, matched, prefill=role is not Role.DECODE)
        try:
            yield self._fleet.get(engine_id)
        finally:
            counts.leave(engine_id)
