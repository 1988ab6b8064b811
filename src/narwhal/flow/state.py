"""Flow control's one decision loop (DESIGN §13), as a state and a step: an event in, the
answers to send out. Pure: `now` and the fleet's room are passed in, nothing is sent here.

The control process keeps one `FlowState` for the whole router. A data plane `Ask`s for each
request; the step answers `Start` (go: placement picks the engines) or `Refuse` (answer now),
at once or later, from a pass run after every event: deadlines first, then, per group (a
model), the queue's next entries while both roles have room. Room is the engines' free slots
(`free_slots`) less the grants whose legs are not placed yet (`Begun` counts a leg placed), so
a burst of asks is not granted past `engines[].max_concurrency` before the data plane's
in-flight counts show it. A request is known here from its ask to its `Done` (or `Withdraw`,
or its worker's loss): rate-limit settlement and output-token charges happen at `Done`.

Preemption (`flow.preempt_priority`, off unless set): when the best waiting request is that
urgent and cannot start because a role is full, the pass asks one running stream of a less
urgent priority, placed on that role, to step aside (`Preempt`). Its data plane cuts the
stream's decode leg off (the engine's slot frees), tells the queue (`Requeue`) and waits here
for a new grant, right behind the requests as urgent as the one it stepped aside for; it goes on
from its last delivered token on a fresh pair (exact migration, `dataplane/migration.py`). A
stream that cannot step aside says `Kept`: for now (between legs, or before its first byte:
asked again a little later) or for good (out of migrations, its generation delivered).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from narwhal.config import KeyPolicy
from narwhal.flow.held import Held
from narwhal.flow.messages import (
    Ask,
    Begun,
    Done,
    Fence,
    FlowEffect,
    FlowEvent,
    Kept,
    Refuse,
    Requeue,
    Resize,
    Start,
    Tick,
    Withdraw,
    WorkerLost,
)
from narwhal.flow.preemption import Preemptions
from narwhal.flow.queue import Entry, WaitQueue
from narwhal.flow.ratelimit import Limits, RateLimiter
from narwhal.flow.reasons import ShedReason
from narwhal.flow.saturation import EngineView, FlowLimits, full_reason

RETRY_AFTER_MAX_S = 60
_RATE_WINDOW = 64  # starts remembered for the recent start rate


# ---------------------------------------------------------------- room
def free_slots(engines: Iterable[EngineView], limits: FlowLimits) -> float:
    """A role's free slots: over its engines with room, `max_concurrency - in_flight`
    (infinite for one without a limit); 0 when none has room."""
    free = 0.0
    for engine in engines:
        if full_reason(engine, limits) is not None:
            continue
        if engine.max_concurrency is None:
            return math.inf
        free += engine.max_concurrency - engine.in_flight
    return free


Room = Callable[[str], Mapping[str, float]]
"""A group's free slots by role (`free_slots` of each role it needs); an empty mapping when
a role has no eligible engine (the request then starts, and the data plane answers it)."""


@dataclass(frozen=True, slots=True)
class Headroom:
    """`slots` of each role only requests of priority `priority` or more urgent (lower) may
    take (`flow.headroom_slots`, `flow.headroom_priority`): without preemption, an urgent
    request arriving at a full fleet waits for a slot to free; with headroom it usually
    finds one, at the cost of slots left idle while no urgent request comes."""

    slots: int = 0
    priority: int = 0


class FlowState:
    """The router's queue, rate limits and grants. `policy_for` gives a key's policy
    (weights and limits, re-read on reload)."""

    def __init__(self, limit: int, policy_for: Callable[[str | None], KeyPolicy]) -> None:
        self.policy_for = policy_for
        self.headroom = Headroom()
        self.queue = WaitQueue(limit, lambda client: self.policy_for(client or None).weight)
        self.limiter = RateLimiter()
        self._held: dict[str, Held] = {}
        self._waiting_groups: dict[str, int] = {}
        self._unplaced: dict[tuple[str, str], int] = {}  # (group, role): grants not placed
        self._starts: deque[float] = deque(maxlen=_RATE_WINDOW)
        self.preemptions = Preemptions()
        # Whether two groups' engines of a role overlap (one engine serving several models:
        # a base model and its LoRA adapters); set by the service from the fleet.
        self.shares: Callable[[str, str, str], bool] = _never

    # ---------------------------------------------------------------- reading
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        """Requests known: waiting or started and not done."""
        return len(self._held)

    def waiting(self) -> int:
        """Requests waiting: in the queue, or preempted and waiting to go on."""
        return len(self.queue) + self.preemptions.waiting()

    def unplaced(self, group: str, role: str) -> int:
        return self._unplaced.get((group, role), 0)

    def next_deadline(self) -> float | None:
        return self.queue.next_deadline()

    def stepping_aside(self, request_id: str) -> int | None:
        """The priority of a stream asked to step aside and not off its engine yet (None:
        not such a stream)."""
        held = self._held.get(request_id)
        return held.ask.priority if held is not None and held.preempting else None

    def key_of(self, request_id: str) -> str | None:
        """The rate-limit key of a request it knows (None: none, or not known)."""
        held = self._held.get(request_id)
        return None if held is None else held.ask.key

    # ---------------------------------------------------------------- the step
    def step(self, event: FlowEvent, now: float, room: Room) -> list[FlowEffect]:
        """Apply `event` at `now`, then run the pass; the answers to send, in order."""
        out: list[FlowEffect] = []
        match event:
            case Ask():
                self._ask(event, now, room, out)
            case Begun(id=request_id, role=role, engine=engine_id):
                held = self._held.get(request_id)
                if held is not None:
                    held.placed[role] = engine_id
                    if role in held.unplaced:
                        held.unplaced.discard(role)
                        self._placed(held.ask.group, role)
            case Done():
                self._done(event, now)
            case Withdraw(id=request_id):
                held = self._forget(request_id)
                if held is not None and held.ask.key is not None:  # its tokens back
                    self.limiter.settle(held.ask.key, held.limits, held.ask.rate_tokens, 0, now)
            case Requeue(id=request_id):
                held = self._held.get(request_id)
                if held is not None and held.preempting:
                    self.preemptions.requeued(held, now)
            case Kept(id=request_id, for_now=for_now):
                held = self._held.get(request_id)
                if held is not None and held.preempting:
                    self.preemptions.kept(held, now if for_now else None)
            case WorkerLost(worker=worker):
                for request_id in [i for i, h in self._held.items() if h.ask.worker == worker]:
                    self._forget(request_id)
            case Fence(reason=reason):
                for entry in self.queue.drain():
                    held = self._forget(entry.id, waiting_taken=True)
                    assert held is not None
                    out.append(self._fenced(held, reason, now))
                for request_id in self.preemptions.resuming():
                    held = self._forget(request_id)
                    assert held is not None
                    out.append(self._fenced(held, reason, now))
                self.limiter = RateLimiter()
            case Resize(limit=limit):
                for entry in self.queue.resize(limit):
                    out.append(self._shed(entry, ShedReason.QUEUE_FULL, now))
            case Tick():
                pass
        self._pass(now, room, out)
        return out

    def prune(self, now: float) -> None:
        """Forget full buckets and idle counters (run now and then: clients come and go)."""
        self.limiter.prune(now, lambda key: Limits.of(self.policy_for(key)))
        self.queue.counters.prune()

    # ---------------------------------------------------------------- asking
    def _ask(self, ask: Ask, now: float, room: Room, out: list[FlowEffect]) -> None:
        if ask.id in self._held:
            return  # asked twice: the first ask stands
        limits = Limits()
        headers: Mapping[str, str] = {}
        if ask.key is not None:
            limits = Limits.of(self.policy_for(ask.key))
            verdict = self.limiter.check(ask.key, limits, ask.rate_tokens, now)
            headers = verdict.headers
            if not verdict.allowed:
                assert verdict.reason is not None
                out.append(self._limited(ask, verdict.reason, verdict.retry_after_s, headers))
                return
        held = Held(ask, limits, waiting=False, enqueued_at=now, preemptible=ask.preemptible)
        if not ask.queue:
            self._held[ask.id] = held
            out.append(Start(ask.id, ask.worker, ask.priority, 0.0, headers))
            return
        group = ask.group
        waits = self.queue.has_waiting(group) or self.preemptions.rank(group) is not None
        if not waits and self._has_room(group, room, ask.priority):
            self._held[ask.id] = held
            self.queue.counters.charge(ask.client, ask.tokens)
            out.append(self._grant(held, room, now, headers))
            return
        entry = Entry(ask.id, ask.client, ask.priority, ask.tokens, now, now + ask.wait_s, group)
        admission = self.queue.admit(entry, now)
        if not admission.accepted:
            if ask.key is not None:  # refused after the rate limit took its share
                self.limiter.settle(ask.key, limits, ask.rate_tokens, 0, now)
            assert admission.reason is not None
            out.append(self._shed_newcomer(ask, admission.reason, now))
            return
        held.waiting = True
        self._held[ask.id] = held
        self._waiting_groups[group] = self._waiting_groups.get(group, 0) + 1
        if admission.shed is not None:
            out.append(self._shed(admission.shed, ShedReason.QUEUE_FULL, now))

    # ---------------------------------------------------------------- the pass
    def _pass(self, now: float, room: Room, out: list[FlowEffect]) -> None:
        for entry in self.queue.expire(now):
            out.append(self._shed(entry, ShedReason.DEADLINE, now))
        preemptions, counters = self.preemptions, self.queue.counters
        groups = [
            *self._waiting_groups,
            *(g for g in preemptions.groups() if g not in self._waiting_groups),
        ]
        blocked: set[str] = set()
        while True:
            # The most urgent next request of the groups not blocked: groups whose engines
            # overlap (a base model and its LoRA adapters) compete for the same slots, so a
            # group's turn is its urgency's, not its place in the list. A group owed the slot
            # its stepped-aside stream freed goes first. (Groups on separate engines do not
            # compete: their order changes nothing.)
            owed = preemptions.owed()
            best: tuple[tuple[bool, int, int], str, int, bool] | None = None
            for index, group in enumerate(groups):
                if group in blocked:
                    continue
                queued = self.queue.next_priority(group)
                rank = preemptions.rank(group)  # a stream that stepped aside, to go on
                resume = rank is not None and (queued is None or rank < queued)
                priority = rank if resume else queued
                if priority is None:
                    blocked.add(group)
                    continue
                order = (group not in owed, priority, index)
                if best is None or order < best[0]:
                    best = (order, group, priority, resume)
            if best is None:
                return
            _, group, priority, resume = best
            lacking = self._lacking(group, room, priority)
            if lacking:
                if not resume:  # one stepped aside never makes another step aside
                    preempt = preemptions.ask(group, lacking, priority, counters.value, now)
                    if preempt is not None:
                        out.append(preempt)
                blocked.add(group)  # its best waiting request cannot start: nothing after it
                continue
            if resume:
                held = self._held[preemptions.resume(group)]
                held.resuming = None
            else:
                head = self.queue.next_start(group)
                assert head is not None
                held = self._held[head.id]
                self._left_queue(held)
            out.append(self._grant(held, room, now, {}))

    def _has_room(self, group: str, room: Room, priority: int) -> bool:
        return not self._lacking(group, room, priority)

    def _lacking(self, group: str, room: Room, priority: int) -> set[str]:
        """The roles without a free slot for a request of `priority`: beyond the headroom's
        priority, a role needs one more than the headroom (those slots wait for urgent
        requests)."""
        kept = self.headroom.slots if priority > self.headroom.priority else 0
        return {
            role for role, free in room(group).items() if free <= self._pending(group, role) + kept
        }

    def _pending(self, group: str, role: str) -> int:
        """Grants not yet placed that `group`'s free slots of `role` must still cover: its own,
        and those of every group whose engines of the role overlap its own (their legs may
        land on the same engines; counted as if they all would)."""
        pending = self.unplaced(group, role)
        for (other, other_role), count in self._unplaced.items():
            if other_role == role and other != group and self.shares(group, other, role):
                pending += count
        return pending

    def _grant(self, held: Held, room: Room, now: float, headers: Mapping[str, str]) -> Start:
        group = held.ask.group
        for role in room(group):
            held.unplaced.add(role)
            self._unplaced[(group, role)] = self.unplaced(group, role) + 1
        self._starts.append(now)
        held.started_at = now
        held.placed = {}
        self.preemptions.started(held)
        waited = now - held.enqueued_at
        return Start(held.ask.id, held.ask.worker, held.ask.priority, waited, headers)

    def _placed(self, group: str, role: str) -> None:
        key = (group, role)
        left = self._unplaced.get(key, 0) - 1
        if left > 0:
            self._unplaced[key] = left
        else:
            self._unplaced.pop(key, None)

    # ---------------------------------------------------------------- ending
    def _done(self, done: Done, now: float) -> None:
        held = self._forget(done.id)
        if held is None:
            return
        ask = held.ask
        if ask.queue and done.output_tokens:
            self.queue.charge(ask.client, done.output_tokens)
        if ask.key is not None and done.output_tokens is not None:
            used = done.output_tokens + (done.prompt_tokens or ask.tokens)
            self.limiter.settle(ask.key, held.limits, ask.rate_tokens, used, now)

    def _forget(self, request_id: str, waiting_taken: bool = False) -> Held | None:
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        self.preemptions.forget(held)
        if held.waiting:
            if not waiting_taken:
                self.queue.remove(request_id)
            self._left_queue(held)
        for role in held.unplaced:
            self._placed(held.ask.group, role)
        held.unplaced.clear()
        return held

    def _left_queue(self, held: Held) -> None:
        held.waiting = False
        group = held.ask.group
        left = self._waiting_groups[group] - 1
        if left:
            self._waiting_groups[group] = left
        else:
            del self._waiting_groups[group]

    # ---------------------------------------------------------------- refusals
    def retry_after_s(self, now: float) -> int:
        """How long the queue takes to start what waits, at the recent start rate (1 to
        `RETRY_AFTER_MAX_S`; 1 with no start seen)."""
        starts = self._starts
        if len(starts) < 2 or now <= starts[0]:
            return 1
        rate = len(starts) / (now - starts[0])
        seconds = math.ceil(len(self.queue) / rate) if rate > 0 else RETRY_AFTER_MAX_S
        return max(1, min(RETRY_AFTER_MAX_S, seconds))

    def _shed(self, entry: Entry, reason: ShedReason, now: float) -> Refuse:
        """A waiting entry refused (the queue took it out already)."""
        held = self._forget(entry.id, waiting_taken=True)
        assert held is not None
        if held.ask.key is not None:
            self.limiter.settle(held.ask.key, held.limits, held.ask.rate_tokens, 0, now)
        return Refuse(
            entry.id, held.ask.worker, 429, reason, _MESSAGES[reason],
            self.retry_after_s(now), {}, entry.priority, now - entry.enqueued_at, held.ask.key,
        )  # fmt: skip

    def _shed_newcomer(self, ask: Ask, reason: ShedReason, now: float) -> Refuse:
        return Refuse(
            ask.id, ask.worker, 429, reason, _MESSAGES[reason], self.retry_after_s(now), {},
            ask.priority, 0.0, ask.key,
        )  # fmt: skip

    def _limited(
        self, ask: Ask, reason: ShedReason, retry_after_s: int | None, headers: Mapping[str, str]
    ) -> Refuse:
        kind = "requests" if reason == ShedReason.REQUESTS_PER_MINUTE else "tokens"
        policy = self.policy_for(ask.key)
        limit = (
            policy.requests_per_minute
            if reason == ShedReason.REQUESTS_PER_MINUTE
            else policy.tokens_per_minute
        )
        if retry_after_s is None:
            message = (
                f"Request too large: it needs {ask.rate_tokens} tokens, and this key's limit "
                f"is {limit} tokens per minute (prompt plus max_tokens)."
            )
        else:
            message = (
                f"Rate limit reached for {kind} per minute: limit {limit}. "
                f"Please try again in {retry_after_s}s."
            )
        return Refuse(
            ask.id, ask.worker, 429, reason, message, retry_after_s, headers, ask.priority, 0.0,
            ask.key,
        )  # fmt: skip

    def _fenced(self, held: Held, reason: str, now: float) -> Refuse:
        if held.ask.key is not None:
            self.limiter.settle(held.ask.key, held.limits, held.ask.rate_tokens, 0, now)
        return Refuse(
            held.ask.id, held.ask.worker, 503, "not_admitted",
            f"not admitting requests: {reason}", 1, {}, held.ask.priority,
            now - held.enqueued_at, held.ask.key,
        )  # fmt: skip


_MESSAGES = {
    ShedReason.QUEUE_FULL: "The server is overloaded: the queue is full. Please retry later.",
    ShedReason.DEADLINE: (
        "The server is overloaded: the request could not start within its wait limit. "
        "Please retry later."
    ),
}


def _never(group: str, other: str, role: str) -> bool:
    """No two groups share an engine (the state alone knows no engines)."""
    return False
