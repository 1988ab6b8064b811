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
stream that cannot step aside right then (between legs, or out of migrations) says `Kept`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from narwhal.config import KeyPolicy
from narwhal.flow.queue import Entry, WaitQueue
from narwhal.flow.ratelimit import Limits, RateLimiter
from narwhal.flow.reasons import ShedReason
from narwhal.flow.saturation import EngineView, FlowLimits, full_reason

RETRY_AFTER_MAX_S = 60
# Roles whose slot a stream holds until it ends: a preempted stream frees one of these.
_HELD_WHILE_STREAMING = frozenset({"decode", "both"})
_RATE_WINDOW = 64  # starts remembered for the recent start rate


# ---------------------------------------------------------------- events in
@dataclass(frozen=True, slots=True)
class Ask:
    """A request asks to start. `group` is its model; `client` whose fair share it is (the
    key's label, else the tenant header, else ""); `key` its rate-limit key (None: none);
    `tokens` what its start charges (prompt tokens, estimated when not counted);
    `rate_tokens` what the rate limit takes (prompt plus `max_tokens`); `wait_s` how long it
    may still wait; `queue` whether flow control orders it (else only its rate limit)."""

    id: str
    group: str
    client: str
    key: str | None
    priority: int
    tokens: int
    rate_tokens: int
    wait_s: float
    queue: bool = True
    worker: int = 0
    preemptible: bool = False  # a stream that may migrate: it can step aside and go on later


@dataclass(frozen=True, slots=True)
class Begun:
    """A granted request placed its leg of `role` (`prefill`, `decode` or `both`): the data
    plane's in-flight count has it from now on."""

    id: str
    role: str
    engine: str = ""  # the engine it was placed on


@dataclass(frozen=True, slots=True)
class Done:
    """A started request ended; `output_tokens` served (None: not known)."""

    id: str
    output_tokens: int | None = None
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Withdraw:
    """The client left (or its worker drains) before the request ended."""

    id: str


@dataclass(frozen=True, slots=True)
class Requeue:
    """A preempted request's leg left its engine: it waits for a new grant to go on."""

    id: str


@dataclass(frozen=True, slots=True)
class Kept:
    """A request asked to step aside could not (not reading a movable stream right now, or
    out of migrations): it runs on, and is not asked again."""

    id: str


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """A worker exited: its requests are gone, waiting or running."""

    worker: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Something outside changed (a scrape, the fleet, the clock): run the pass."""


@dataclass(frozen=True, slots=True)
class Fence:
    """This router no longer admits (the lease lost, the monitor closed admission): every
    waiting request is answered 503 now; the rate-limit buckets are dropped."""

    reason: str


@dataclass(frozen=True, slots=True)
class Resize:
    """A reload: the queue's new limit (what it sheds is answered)."""

    limit: int


FromDataPlane = Ask | Begun | Done | Withdraw | Requeue | Kept
"""What a data plane tells flow control about its requests."""
FlowEvent = FromDataPlane | WorkerLost | Tick | Fence | Resize


# ---------------------------------------------------------------- answers out
@dataclass(frozen=True, slots=True)
class Start:
    id: str
    worker: int
    priority: int
    waited_s: float
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer the request now: `status` (429 or 503), OpenAI's error `type` and `code`,
    `Retry-After` (None: none, e.g. a request larger than its key's whole limit), and the
    `x-ratelimit-*` headers. `reason` is a `ShedReason` value, or `not_admitted`."""

    id: str
    worker: int
    status: int
    reason: str
    message: str
    retry_after_s: int | None
    headers: Mapping[str, str]
    priority: int
    waited_s: float = 0.0
    key: str | None = None  # the client key's label, for the refusals counted by key

    @property
    def error_type(self) -> str:
        if self.status == 503:
            return "service_unavailable"
        return "tokens" if self.reason == ShedReason.TOKENS_PER_MINUTE else "requests"

    @property
    def code(self) -> str:
        return "not_admitted" if self.status == 503 else "rate_limit_exceeded"


@dataclass(frozen=True, slots=True)
class Preempt:
    """Ask a running stream (of `priority`) to step aside for a more urgent request."""

    id: str
    worker: int
    priority: int


FlowEffect = Start | Refuse | Preempt


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


Frees = Callable[[str, str], bool]
"""Whether one request fewer on an engine (role, engine id) would give its role room: it is
full by Narwhal's own count only, not by its scraped queue or KV cache. Preemption asks only
a stream whose leaving would."""


@dataclass(frozen=True, slots=True)
class Headroom:
    """`slots` of each role only requests of priority `priority` or more urgent (lower) may
    take (`flow.headroom_slots`, `flow.headroom_priority`): without preemption, an urgent
    request arriving at a full fleet waits for a slot to free; with headroom it usually
    finds one, at the cost of slots left idle while no urgent request comes."""

    slots: int = 0
    priority: int = 0


@dataclass(slots=True)
class _Held:
    ask: Ask
    limits: Limits
    waiting: bool
    enqueued_at: float
    unplaced: set[str] = field(default_factory=set)  # roles granted, not yet placed
    placed: dict[str, str] = field(default_factory=dict)  # role: engine, since its last grant
    started_at: float = 0.0  # its (last) grant
    preemptible: bool = False  # may be asked to step aside (`Ask.preemptible`, until `Kept`)
    preempting: bool = False  # asked to step aside; its leg not yet off its engine
    preempted: int = 0  # times it stepped aside
    stepped_for: int = 0  # the priority of the request it last stepped aside for
    resuming: tuple[int, int] | None = None  # stepped aside: (rank, turn) to go on


class FlowState:
    """The router's queue, rate limits and grants. `policy_for` gives a key's policy
    (weights and limits, re-read on reload)."""

    def __init__(self, limit: int, policy_for: Callable[[str | None], KeyPolicy]) -> None:
        self.policy_for = policy_for
        self.headroom = Headroom()
        self.queue = WaitQueue(limit, lambda client: self.policy_for(client or None).weight)
        self.limiter = RateLimiter()
        self._held: dict[str, _Held] = {}
        self._waiting_groups: dict[str, int] = {}
        self._unplaced: dict[tuple[str, str], int] = {}  # (group, role): grants not placed
        self._starts: deque[float] = deque(maxlen=_RATE_WINDOW)
        # Preemption: the urgency that may ask for it (None: off); by group, the running
        # streams that may step aside, those asked and not yet off, and those waiting to go
        # on, as (rank, turn, id) in order.
        self.preempt_priority: int | None = None
        self.frees: Frees = lambda role, engine_id: True
        self._running: dict[str, dict[str, _Held]] = {}
        self._preempting: dict[str, int] = {}
        self._resumes: dict[str, list[tuple[int, int, str]]] = {}
        self._turns = 0

    # ---------------------------------------------------------------- reading
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        """Requests known: waiting or started and not done."""
        return len(self._held)

    def waiting(self) -> int:
        """Requests waiting: in the queue, or preempted and waiting to go on."""
        return len(self.queue) + sum(len(r) for r in self._resumes.values())

    def unplaced(self, group: str, role: str) -> int:
        return self._unplaced.get((group, role), 0)

    def next_deadline(self) -> float | None:
        return self.queue.next_deadline()

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
                    self._requeued(held, now)
            case Kept(id=request_id):
                held = self._held.get(request_id)
                if held is not None and held.preempting:
                    self._not_preempting(held)
                    held.preemptible = False
                    self._not_running(held)
            case WorkerLost(worker=worker):
                for request_id in [i for i, h in self._held.items() if h.ask.worker == worker]:
                    self._forget(request_id)
            case Fence(reason=reason):
                for entry in self.queue.drain():
                    held = self._forget(entry.id, waiting_taken=True)
                    assert held is not None
                    out.append(self._fenced(held, reason, now))
                for resumes in list(self._resumes.values()):
                    for _, _, request_id in list(resumes):
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
        held = _Held(ask, limits, waiting=False, enqueued_at=now, preemptible=ask.preemptible)
        if not ask.queue:
            self._held[ask.id] = held
            out.append(Start(ask.id, ask.worker, ask.priority, 0.0, headers))
            return
        group = ask.group
        waits = self.queue.has_waiting(group) or group in self._resumes
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
        groups = [
            *self._waiting_groups,
            *(g for g in self._resumes if g not in self._waiting_groups),
        ]
        for group in groups:
            while True:
                queued = self.queue.next_priority(group)
                resumes = self._resumes.get(group)
                # A stream that stepped aside goes on right after the requests as urgent as
                # the one it stepped aside for: it began before every one waiting, and only
                # lent its slot (ranked by its own priority, a busy fleet's more urgent
                # traffic would keep it waiting past its deadline with its client mid-answer).
                resume = resumes is not None and (queued is None or resumes[0][0] < queued)
                priority = resumes[0][0] if resume and resumes is not None else queued
                if priority is None:
                    break
                lacking = self._lacking(group, room, priority)
                if lacking:
                    if not resume:  # one stepped aside never makes another step aside
                        self._preempt(group, lacking, priority, out)
                    break  # the best waiting request cannot start: nothing after it can
                if resume and resumes is not None:
                    _, _, request_id = resumes.pop(0)
                    if not resumes:
                        del self._resumes[group]
                    held = self._held[request_id]
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
            role for role, free in room(group).items() if free <= self.unplaced(group, role) + kept
        }

    # ---------------------------------------------------------------- preemption
    def _preempt(self, group: str, lacking: set[str], priority: int, out: list[FlowEffect]) -> None:
        """Ask one running stream of a less urgent priority to step aside for a waiting
        request of `priority`, when that is urgent enough, none asked is still on its engine,
        and the roles it lacks are ones a stream holds for its whole length (a prefill's slot
        frees on its own within the prefill)."""
        if (
            self.preempt_priority is None
            or priority > self.preempt_priority
            or self._preempting.get(group)
            or not lacking <= _HELD_WHILE_STREAMING
        ):
            return
        frees = self.frees
        victims = [
            h
            for h in self._running.get(group, {}).values()
            if h.ask.priority > priority
            and not h.preempting
            and all(role in h.placed and frees(role, h.placed[role]) for role in lacking)
        ]
        if not victims:
            return
        # The least urgent; then the one that stepped aside the fewest times; then the latest
        # started (the least to compute again).
        victim = max(victims, key=lambda h: (h.ask.priority, -h.preempted, h.started_at))
        victim.preempting = True
        victim.preempted += 1
        victim.stepped_for = priority
        self._preempting[group] = self._preempting.get(group, 0) + 1
        out.append(Preempt(victim.ask.id, victim.ask.worker, victim.ask.priority))

    def _requeued(self, held: _Held, now: float) -> None:
        """A preempted stream is off its engine: it waits for a grant to go on."""
        self._not_preempting(held)
        self._not_running(held)
        group = held.ask.group
        self._turns += 1
        held.resuming = (held.stepped_for, self._turns)
        held.enqueued_at = now
        bisect.insort(self._resumes.setdefault(group, []), (*held.resuming, held.ask.id))

    def _not_running(self, held: _Held) -> None:
        """Out of the streams that may be asked to step aside."""
        running = self._running.get(held.ask.group)
        if running is not None and running.pop(held.ask.id, None) is not None and not running:
            del self._running[held.ask.group]

    def _not_preempting(self, held: _Held) -> None:
        held.preempting = False
        group = held.ask.group
        left = self._preempting[group] - 1
        if left:
            self._preempting[group] = left
        else:
            del self._preempting[group]

    def _grant(self, held: _Held, room: Room, now: float, headers: Mapping[str, str]) -> Start:
        group = held.ask.group
        for role in room(group):
            held.unplaced.add(role)
            self._unplaced[(group, role)] = self.unplaced(group, role) + 1
        self._starts.append(now)
        held.started_at = now
        held.placed = {}
        if held.preemptible:
            self._running.setdefault(group, {})[held.ask.id] = held
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

    def _forget(self, request_id: str, waiting_taken: bool = False) -> _Held | None:
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        group = held.ask.group
        if held.preempting:
            self._not_preempting(held)
        self._not_running(held)
        if held.resuming is not None:
            resumes = self._resumes[group]
            resumes.remove((*held.resuming, request_id))
            if not resumes:
                del self._resumes[group]
        if held.waiting:
            if not waiting_taken:
                self.queue.remove(request_id)
            self._left_queue(held)
        for role in held.unplaced:
            self._placed(held.ask.group, role)
        held.unplaced.clear()
        return held

    def _left_queue(self, held: _Held) -> None:
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

    def _fenced(self, held: _Held, reason: str, now: float) -> Refuse:
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
