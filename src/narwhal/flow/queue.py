"""The router's one wait queue (DESIGN §13): who starts next, who is refused. Pure: `now` is
passed in, and every answer is the caller's to send.

Order: the lowest `priority` number first (vLLM's meaning); within a priority the client with
the least virtual token counter (`vtc.py`); within a client, first come first served. Each
entry belongs to a `group` (the engines it needs, such as its model): `next_start(group)` only
looks at that group's entries, so a full model does not hold up another. `limit` bounds the
whole queue: a full queue refuses its worst entry, the highest priority number, then the
most-served client counting what it has waiting (its counter plus its waiting requests'
tokens: the virtual finish of its newest), then that client's newest entry; the newcomer itself
when it is no better. So a client that fills the queue loses its own newest requests, never a
client with one request waiting.
An entry that can no longer start before its `deadline` is taken out by `expire(now)`.

Every operation is O(log n) amortised, with ties broken by arrival: the same calls give the
same answers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from narwhal.flow.heap import KeyedHeap
from narwhal.flow.reasons import ShedReason
from narwhal.flow.vtc import VirtualCounters, uniform


@dataclass(frozen=True, slots=True)
class Entry:
    """A request waiting to start. `tokens` is what its start charges its client (its prompt
    tokens, estimated when not counted); `deadline` is the last moment it may start."""

    id: str
    client: str
    priority: int
    tokens: int
    enqueued_at: float
    deadline: float
    group: str = ""


@dataclass(frozen=True, slots=True)
class Admission:
    """`admit`'s answer. Accepted with `shed` set: that waiting entry was refused to make
    room and must be answered now. Not accepted: `shed` is the newcomer itself."""

    accepted: bool
    shed: Entry | None = None
    reason: ShedReason | None = None


_Lane = tuple[str, int, str]  # (group, priority, client): one client's entries, FIFO
_Level = tuple[str, int]  # (group, priority)


class WaitQueue:
    def __init__(self, limit: int, weight: Callable[[str], float] = uniform) -> None:
        self.limit = limit
        self.counters = VirtualCounters(weight)
        self._seq = 0
        self._waiting: dict[str, tuple[Entry, int, float]] = {}  # entry, seq, its cost
        self._queued: dict[str, float] = {}  # per client: its waiting entries' costs
        self._lanes: dict[_Lane, OrderedDict[str, int]] = {}
        self._client_lanes: dict[str, set[_Lane]] = {}
        self._starts: dict[_Level, KeyedHeap[str]] = {}  # clients by (counter, head's seq)
        self._levels: dict[str, KeyedHeap[int]] = {}  # a group's priorities with entries
        self._shed: KeyedHeap[_Lane] = KeyedHeap()  # worst first: (-priority, -counter, -tail)
        self._deadlines: KeyedHeap[str] = KeyedHeap()
        self._depth: dict[int, int] = {}

    # ---------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._waiting

    def __iter__(self) -> Iterator[Entry]:
        """The waiting entries, in arrival order."""
        ordered = sorted(self._waiting.values(), key=lambda waiting: waiting[1])
        return iter([waiting[0] for waiting in ordered])

    def get(self, entry_id: str) -> Entry | None:
        found = self._waiting.get(entry_id)
        return None if found is None else found[0]

    def depth(self) -> Mapping[int, int]:
        """Waiting entries by priority (`narwhal_queue_depth{priority}`)."""
        return dict(self._depth)

    def has_waiting(self, group: str = "") -> bool:
        """Whether `group` has waiting entries: a newcomer then waits its turn too, even when
        an engine has room."""
        return group in self._levels

    def next_deadline(self) -> float | None:
        """When `expire` next has something to take out."""
        top = self._deadlines.peek()
        return None if top is None else top[1][0]

    # ---------------------------------------------------------------- deciding
    def admit(self, entry: Entry, now: float) -> Admission:
        """Queue `entry`, or refuse it; a full queue may refuse another entry instead."""
        if entry.id in self._waiting:
            raise ValueError(f"entry {entry.id!r} is already waiting")
        if entry.deadline <= now:
            return Admission(False, entry, ShedReason.DEADLINE)
        shed = None
        if len(self._waiting) >= self.limit:
            worst = self._shed.peek()
            if worst is None or self._newcomer_rank(entry) <= worst[1]:
                return Admission(False, entry, ShedReason.QUEUE_FULL)
            shed = self._shed_worst()
        self._insert(entry)
        return Admission(True, shed, None if shed is None else ShedReason.QUEUE_FULL)

    def next_priority(self, group: str = "") -> int | None:
        """The priority of the entry of `group` that starts next (None: none waits)."""
        levels = self._levels.get(group)
        top = None if levels is None else levels.peek()
        return None if top is None else top[0]

    def next_start(self, group: str = "") -> Entry | None:
        """Take the entry of `group` that starts next, charging its client its `tokens`;
        None when the group has none waiting."""
        levels = self._levels.get(group)
        if levels is None:
            return None
        top = levels.peek()
        assert top is not None
        priority = top[0]
        first = self._starts[(group, priority)].peek()
        assert first is not None
        lane = self._lanes[(group, priority, first[0])]
        return self._take(next(iter(lane)), charge=True)

    def charge(self, client: str, tokens: float) -> None:
        """Count tokens served to `client` outside a start (output tokens as delivered; a
        request that started without waiting), and reorder its waiting entries."""
        self.counters.charge(client, tokens)
        self._rerank(client)

    def expire(self, now: float) -> list[Entry]:
        """Take out every entry that can no longer start before its deadline; each is
        answered at once (429, `ShedReason.DEADLINE`)."""
        gone: list[Entry] = []
        while (top := self._deadlines.peek()) is not None and top[1][0] <= now:
            gone.append(self._take(top[0]))
        return gone

    def remove(self, entry_id: str) -> Entry | None:
        """Take out an entry whose client left (or whose worker died); None if not waiting."""
        if entry_id not in self._waiting:
            return None
        return self._take(entry_id)

    def drain(self) -> list[Entry]:
        """Take out every entry, in arrival order (a fenced router answers them all)."""
        entries = list(self)
        for entry in entries:
            self._take(entry.id)
        return entries

    def resize(self, limit: int) -> list[Entry]:
        """A new limit (a reload); the entries refused to fit under it, worst first."""
        self.limit = limit
        shed: list[Entry] = []
        while len(self._waiting) > limit:
            shed.append(self._shed_worst())
        return shed

    # ---------------------------------------------------------------- bookkeeping
    def _newcomer_rank(self, entry: Entry) -> tuple[float, ...]:
        """The newcomer's shed rank, as if it were waiting (newest of all: it loses ties)."""
        client = entry.client
        served = self.counters.lifted(client) + self._queued.get(client, 0.0)
        served += entry.tokens / self.counters.weight(client)
        return (-entry.priority, -served, -(self._seq + 1))

    def _shed_worst(self) -> Entry:
        """Take out the worst waiting entry: the newest of the worst lane."""
        worst = self._shed.peek()
        assert worst is not None
        return self._take(next(reversed(self._lanes[worst[0]])))

    def _insert(self, entry: Entry) -> None:
        self._seq += 1
        seq = self._seq
        client = entry.client
        if client not in self._client_lanes:
            self.counters.join(client)
            self._client_lanes[client] = set()
        lane = (entry.group, entry.priority, client)
        ids = self._lanes.get(lane)
        if ids is None:
            ids = self._lanes[lane] = OrderedDict()
            self._client_lanes[client].add(lane)
        ids[entry.id] = seq
        cost = entry.tokens / self.counters.weight(client)
        self._waiting[entry.id] = (entry, seq, cost)
        self._queued[client] = self._queued.get(client, 0.0) + cost
        self._deadlines.set(entry.id, (entry.deadline, seq))
        self._depth[entry.priority] = self._depth.get(entry.priority, 0) + 1
        self._levels.setdefault(entry.group, KeyedHeap()).set(entry.priority, (entry.priority,))
        self._rerank(client)

    def _take(self, entry_id: str, charge: bool = False) -> Entry:
        entry, _, cost = self._waiting.pop(entry_id)
        client = entry.client
        self._queued[client] -= cost
        lane = (entry.group, entry.priority, client)
        ids = self._lanes[lane]
        del ids[entry_id]
        self._deadlines.discard(entry_id)
        depth = self._depth[entry.priority] - 1
        if depth:
            self._depth[entry.priority] = depth
        else:
            del self._depth[entry.priority]
        if not ids:
            self._drop_lane(lane)
        if charge:
            self.counters.charge(client, entry.tokens)
        self._rerank(client)
        return entry

    def _drop_lane(self, lane: _Lane) -> None:
        group, priority, client = lane
        del self._lanes[lane]
        self._shed.discard(lane)
        level = (group, priority)
        starts = self._starts[level]
        starts.discard(client)
        if not starts:
            del self._starts[level]
            levels = self._levels[group]
            levels.discard(priority)
            if not levels:
                del self._levels[group]
        lanes = self._client_lanes[client]
        lanes.discard(lane)
        if not lanes:
            del self._client_lanes[client]
            del self._queued[client]
            self.counters.leave(client)

    def _rerank(self, client: str) -> None:
        for lane in self._client_lanes.get(client, ()):
            self._rank_lane(lane)

    def _rank_lane(self, lane: _Lane) -> None:
        group, priority, client = lane
        ids = self._lanes[lane]
        counter = self.counters.value(client)
        head = ids[next(iter(ids))]
        tail = ids[next(reversed(ids))]
        self._starts.setdefault((group, priority), KeyedHeap()).set(client, (counter, head))
        # Shedding counts what the client has waiting too: its service once all of it has
        # started (the virtual finish of its newest request). A client with one request
        # waiting is not refused for a client that fills the queue.
        served = counter + self._queued[client]
        self._shed.set(lane, (-priority, -served, -tail))
