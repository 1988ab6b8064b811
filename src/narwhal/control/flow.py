"""Flow control's service in the control process (DESIGN §13): the one `FlowState` of the
router, fed by every data plane's asks and by the clock, its answers delivered back.

The room it decides on is read live at each step: each role's eligible engines of the
request's model, Narwhal's in-flight on each (summed over the workers), their
`max_concurrency`, and the last scrape of their own queue and KV usage. A pass runs on every
event, at the next deadline, and every `TICK_S` while requests wait (a slot may be
freed without an event). When admission closes (the lease lost, the monitor degraded) every
waiting request is answered 503 at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping

from narwhal.clock import Clock
from narwhal.config import Config, Role
from narwhal.fleet.admission import Admission
from narwhal.fleet.store import Fleet
from narwhal.flow.messages import (
    Done,
    Fence,
    FlowEffect,
    FlowEvent,
    Refuse,
    Requeue,
    Resize,
    Start,
    Tick,
)
from narwhal.flow.reasons import ShedReason
from narwhal.flow.saturation import EngineView, FlowLimits, freed_by_one
from narwhal.flow.state import FlowState, Headroom, free_slots
from narwhal.placement.load import EngineLoad
from narwhal.telemetry.metrics import FlowMetrics

log = logging.getLogger("narwhal.flow")

TICK_S = 0.01  # while requests wait: a slot freed without an event is seen within this
PRUNE_S = 60.0  # full buckets and idle counters forgotten this often

Deliver = Callable[[FlowEffect], None]


def _undelivered(effect: FlowEffect) -> None:
    log.warning("flow: no data plane to answer %s", effect.id)


class FlowService:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        clock: Clock,
        admission: Admission,
        metrics: FlowMetrics,
        loads: Callable[[], Mapping[str, EngineLoad]],
    ) -> None:
        self._fleet = fleet
        self._clock = clock
        self._admission = admission
        self._metrics = metrics
        self._loads = loads
        self.deliver: Deliver = _undelivered  # set by the router: a worker's channel, or local
        self._wake = asyncio.Event()
        # Events sent while one is handled (one process: a data plane's answer to a delivered
        # effect, such as `Kept`), handled after it, in order, not inside it.
        self._later: deque[FlowEvent] | None = None
        self._pruned_at = clock.monotonic()
        self.state = FlowState(config.flow.queue_limit, config.auth.policy_for)
        # What `/admin/flow` shows, since the start: refusals by reason (`not_admitted`: a
        # 503 of a closed admission), the same by client key, output tokens by key.
        self.refused: Counter[str] = Counter(dict.fromkeys(_REFUSAL_REASONS, 0))
        self.refused_by_key: dict[str, Counter[str]] = {}
        self.served_tokens: Counter[str] = Counter()
        self.preempted: Counter[int] = Counter()  # streams that stepped aside, by priority
        self._apply(config)

    def _apply(self, config: Config) -> None:
        self._limits = FlowLimits.of(config.flow)
        self._stale_s = config.placement.metrics_stale_s
        self.state.policy_for = config.auth.policy_for
        self.state.headroom = Headroom(config.flow.headroom_slots, config.flow.headroom_priority)
        self.state.preemptions.priority = config.flow.preempt_priority
        self.state.preemptions.frees = self.frees
        self.state.shares = self.shares

    def reconfigure(self, config: Config) -> None:
        """A reload: the new limits and key policies; the queue resized (what it sheds is
        answered); counters and buckets stay."""
        self._apply(config)
        self.handle(Resize(config.flow.queue_limit))

    # ---------------------------------------------------------------- the step
    def handle(self, event: FlowEvent) -> None:
        """Apply one event and deliver its answers, in this call. While requests wait, a
        closed admission (the lease lost on the local clock) fences first: an event that
        frees a slot (a request's end, a scrape) never starts a waiting request of a router
        that no longer admits, even before the clock's next tick. An event sent while one is
        handled waits for it (with one process, a stream that cannot step aside answers
        `Kept` from inside the delivery of its `Preempt`: handled there, each answer would
        ask the next stream one call deeper)."""
        if self._later is not None:
            self._later.append(event)
            return
        self._later = deque((event,))
        try:
            while self._later:
                self._handle(self._later.popleft())
        finally:
            self._later = None

    def _handle(self, event: FlowEvent) -> None:
        if self.state.waiting() and not isinstance(event, Fence):
            closed = self._admission.closed_reason()
            if closed is not None:  # first, not after this event
                self._log_fence(closed)
                self._handle(Fence(closed))
        now = self._clock.monotonic()
        if isinstance(event, Done) and event.output_tokens:
            key = self.state.key_of(event.id)
            if key is not None:
                self._metrics.client_tokens.labels(key).inc(event.output_tokens)
                self.served_tokens[key] += event.output_tokens
        if isinstance(event, Requeue):
            stepped = self.state.stepping_aside(event.id)
            if stepped is not None:  # counted once it is off its engine, however often asked
                self._metrics.preemptions.labels(str(stepped)).inc()
                self.preempted[stepped] += 1
        room = self.room
        closed = self._admission.closed_reason() if isinstance(event, Requeue) else None
        if closed is not None:  # a stream stepped aside as the router stopped admitting
            room = self._no_room  # it waits, to be answered with the others, not started
        for effect in self.state.step(event, now, room):
            self._count(effect)
            self.deliver(effect)
        if closed is not None and self.state.waiting():
            self._log_fence(closed)
            self._handle(Fence(closed))
        self._metrics.observe_depth(self.state.queue.depth())
        if self.state.waiting():
            self._wake.set()

    def send(self, event: FlowEvent) -> None:
        """With one process, the data plane's link: the same step, no channel."""
        self.handle(event)

    def _count(self, effect: FlowEffect) -> None:
        priority = str(effect.priority)
        if isinstance(effect, Start):
            if effect.waited_s > 0:
                self._metrics.queue_wait.labels(priority).observe(effect.waited_s)
        elif isinstance(effect, Refuse):
            self.refused[effect.reason] += 1
            if effect.key is not None:
                self.refused_by_key.setdefault(effect.key, Counter())[effect.reason] += 1
            if effect.reason in _SHED_REASONS:
                self._metrics.shed.labels(effect.reason).inc()
            if effect.waited_s > 0:
                self._metrics.queue_wait.labels(priority).observe(effect.waited_s)

    def room(self, group: str) -> Mapping[str, float]:
        """Each role's free slots for `group` (a model); empty when a role has no eligible
        engine: the data plane then answers `no capacity` at once, not after a wait."""
        now = self._clock.monotonic()
        fleet, loads = self._fleet, self._loads()
        free: dict[str, float] = {}
        for role in fleet.needed_roles(group):
            if role is Role.EMBED:
                return {}
            candidates = fleet.candidates(role, now, group)
            if not candidates:
                return {}
            views = [
                EngineView.of(
                    c.id,
                    c.in_flight,
                    fleet.get(c.id).config.max_concurrency,
                    loads.get(c.id),
                    now,
                    self._stale_s,
                )
                for c in candidates
            ]
            free[role.value] = free_slots(views, self._limits)
        return free

    def shares(self, group: str, other: str, role: str) -> bool:
        """Whether an eligible engine of `role` serves both models (a base model and its LoRA
        adapters on one engine): a grant of one then takes a slot the other counted free."""
        fleet, now, needed = self._fleet, self._clock.monotonic(), Role(role)
        mine = {c.id for c in fleet.candidates(needed, now, group)}
        return any(c.id in mine for c in fleet.candidates(needed, now, other))

    def _no_room(self, group: str) -> Mapping[str, float]:
        return dict.fromkeys(self.room(group), 0.0)

    def frees(self, group: str, role: str, engine_id: str) -> bool:
        """Whether one request fewer on `engine_id` would give `group`'s `role` room: it is
        one of the role's candidates (a slot freed on an engine held, draining or ejected
        serves nobody) and full by its `max_concurrency` alone (`freed_by_one`). Preemption
        asks only a stream whose leaving would."""
        fleet, now = self._fleet, self._clock.monotonic()
        engine = fleet.find(engine_id)
        if engine is None:  # gone meanwhile
            return False
        if all(c.id != engine_id for c in fleet.candidates(Role(role), now, group)):
            return False
        config = engine.config
        view = EngineView.of(
            engine_id, fleet.in_flight.of(engine_id), config.max_concurrency,
            self._loads().get(engine_id), now, self._stale_s,
        )  # fmt: skip
        return freed_by_one(view, self._limits)

    # ---------------------------------------------------------------- the clock
    async def run(self) -> None:
        """Deadlines, freed slots and a closed admission, until cancelled."""
        while True:
            if not self.state.waiting():
                self._wake.clear()
                await self._wake.wait()
            now = self._clock.monotonic()
            deadline = self.state.next_deadline()
            delay = TICK_S if deadline is None else min(TICK_S, max(0.0, deadline - now))
            await self._clock.sleep(delay)
            self.tick()

    def tick(self) -> None:
        closed = self._admission.closed_reason()
        if closed is not None and self.state.waiting():
            self.fence(closed)
            return
        now = self._clock.monotonic()
        if now - self._pruned_at >= PRUNE_S:
            self._pruned_at = now
            self.state.prune(now)
        self.handle(Tick())

    def fence(self, reason: str) -> None:
        """Answer every waiting request 503 now and drop the rate-limit buckets (a fenced
        router; the new active starts with an empty queue and full buckets)."""
        self._log_fence(reason)
        self.handle(Fence(reason))

    def _log_fence(self, reason: str) -> None:
        log.warning("flow: not admitting (%s): answering %d waiting", reason, self.state.waiting())


_SHED_REASONS = frozenset(r.value for r in ShedReason)
NOT_ADMITTED = "not_admitted"  # a 503: admission closed (not shedding)
_REFUSAL_REASONS = (*sorted(_SHED_REASONS), NOT_ADMITTED)
