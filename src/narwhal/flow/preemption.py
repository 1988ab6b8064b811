"""Preemption's bookkeeping for `FlowState` (`flow.preempt_priority`, off unless set;
docs/flow.md "Preemption"). By group (a model): the running streams that may be asked to
step aside, how many were asked and are not off their engine yet, and those off it, waiting
to go on, in order. Pure like the step it serves: it picks, it sends nothing.

A stream that stepped aside goes on right after the requests as urgent as the one it stepped
aside for (its rank): it began before every one waiting, and only lent its slot (ranked by its
own priority, a busy fleet's more urgent traffic would keep it waiting past its deadline with
its client mid-answer). Within a rank, in the order they stepped aside."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from narwhal.flow.held import Held
from narwhal.flow.messages import Preempt

Frees = Callable[[str, str, str], bool]
"""Whether one request fewer on an engine (group, role, engine id) would give the group's role
room: the engine may take the group's new work (eligible), and it is full by Narwhal's own
count only, not by its scraped queue or KV cache. Preemption asks only a stream whose leaving
would."""

# A stream that could not step aside yet (`Kept.for_now`: its decode placed, its first byte
# not yet read) is asked again no sooner than this: a decode's first token is tens of ms away.
ASK_AGAIN_S = 0.05

# Roles whose slot a stream holds until it ends: a preempted stream frees one of these.
_HELD_WHILE_STREAMING = frozenset({"decode", "both"})


class Preemptions:
    """`priority`: the urgency that may ask a stream to step aside (None: off); `frees` as
    above (the control process's view of the fleet)."""

    def __init__(self) -> None:
        self.priority: int | None = None
        self.frees: Frees = lambda group, role, engine_id: True
        self._running: dict[str, dict[str, Held]] = {}
        self._asked: dict[str, int] = {}
        self._resumes: dict[str, list[tuple[int, int, str]]] = {}
        # Groups whose stream stepped aside and which have not been granted since: the slot
        # freed is theirs first (engines shared by models: another model's request must not
        # take it).
        self._owed: dict[str, int] = {}
        self._turns = 0

    # ---------------------------------------------------------------- reading
    def waiting(self) -> int:
        """Streams off their engine, waiting to go on."""
        return sum(len(r) for r in self._resumes.values())

    def groups(self) -> Iterator[str]:
        """The groups with a stream waiting to go on."""
        return iter(self._resumes)

    def rank(self, group: str) -> int | None:
        """The rank of the group's next stream to go on (None: none waits)."""
        resumes = self._resumes.get(group)
        return None if resumes is None else resumes[0][0]

    def owed(self) -> list[str]:
        """The groups owed a grant for a slot their stepped-aside stream freed."""
        return list(self._owed)

    def resuming(self) -> list[str]:
        """Every stream waiting to go on (a fence answers them)."""
        return [request_id for r in self._resumes.values() for _, _, request_id in r]

    # ---------------------------------------------------------------- changes
    def started(self, held: Held) -> None:
        """Granted: a stream that may step aside is a candidate from now on. The group's
        first grant after a stream stepped aside pays what it was owed."""
        group = held.ask.group
        owed = self._owed.get(group)
        if owed is not None:
            if owed > 1:
                self._owed[group] = owed - 1
            else:
                del self._owed[group]
        if held.preemptible:
            self._running.setdefault(held.ask.group, {})[held.ask.id] = held

    def ask(
        self,
        group: str,
        lacking: set[str],
        priority: int,
        served: Callable[[str], float],
        now: float,
    ) -> Preempt | None:
        """One running stream of a less urgent priority to step aside for a waiting request
        of `priority`, when that is urgent enough, none asked is still on its engine, and the
        roles it lacks are ones a stream holds for its whole length (a prefill's slot frees on
        its own within the prefill). The least urgent; then the most served client's (its
        virtual counter, `served`: the client the queue would shed first); then the one that
        stepped aside the fewest times; then the latest started (the least to compute again)."""
        if (
            self.priority is None
            or priority > self.priority
            or self._asked.get(group)
            or not lacking <= _HELD_WHILE_STREAMING
        ):
            return None
        frees = self.frees
        victims = [
            h
            for h in self._running.get(group, {}).values()
            if h.ask.priority > priority
            and not h.preempting
            and h.ask_again_at <= now
            and all(role in h.placed and frees(group, role, h.placed[role]) for role in lacking)
        ]
        if not victims:
            return None
        victim = max(
            victims,
            key=lambda h: (h.ask.priority, served(h.ask.client), -h.preempted, h.started_at),
        )
        victim.preempting = True
        victim.preempted += 1
        victim.stepped_for = priority
        self._asked[group] = self._asked.get(group, 0) + 1
        return Preempt(victim.ask.id, victim.ask.worker, victim.ask.priority)

    def requeued(self, held: Held, now: float) -> None:
        """A stream asked is off its engine: it waits to go on."""
        self._not_asked(held)
        self._not_running(held)
        self._owed[held.ask.group] = self._owed.get(held.ask.group, 0) + 1
        self._turns += 1
        held.resuming = (held.stepped_for, self._turns)
        held.enqueued_at = now
        bisect.insort(self._resumes.setdefault(held.ask.group, []), (*held.resuming, held.ask.id))

    def kept(self, held: Held, for_now_at: float | None = None) -> None:
        """A stream asked could not step aside: it runs on, and is not asked again; or, when
        it could not yet (`Kept.for_now`, told at `for_now_at`), not before `ASK_AGAIN_S`."""
        self._not_asked(held)
        if for_now_at is not None:
            held.ask_again_at = for_now_at + ASK_AGAIN_S
            return
        held.preemptible = False
        self._not_running(held)

    def resume(self, group: str) -> str:
        """The group's next stream to go on, out of the waiting ones."""
        resumes = self._resumes[group]
        _, _, request_id = resumes.pop(0)
        if not resumes:
            del self._resumes[group]
        return request_id

    def forget(self, held: Held) -> None:
        """The request ended (or was answered, or its worker was lost)."""
        if held.preempting:
            self._not_asked(held)
        self._not_running(held)
        if held.resuming is not None:
            group = held.ask.group
            resumes = self._resumes[group]
            resumes.remove((*held.resuming, held.ask.id))
            if not resumes:
                del self._resumes[group]

    def _not_running(self, held: Held) -> None:
        running = self._running.get(held.ask.group)
        if running is not None and running.pop(held.ask.id, None) is not None and not running:
            del self._running[held.ask.group]

    def _not_asked(self, held: Held) -> None:
        held.preempting = False
        group = held.ask.group
        left = self._asked[group] - 1
        if left:
            self._asked[group] = left
        else:
            del self._asked[group]
