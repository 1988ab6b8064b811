"""What flow control knows of one request, from its ask to its end (`FlowState`'s record):
where it waits or runs, the roles granted and not yet placed, and, with preemption on, where
it runs and whether it stepped aside."""

from __future__ import annotations

from dataclasses import dataclass, field

from narwhal.flow.messages import Ask
from narwhal.flow.ratelimit import Limits


@dataclass(slots=True)
class Held:
    ask: Ask
    limits: Limits
    waiting: bool  # in the queue
    enqueued_at: float
    unplaced: set[str] = field(default_factory=set)  # roles granted, not yet placed
    placed: dict[str, str] = field(default_factory=dict)  # role: engine, since its last grant
    started_at: float = 0.0  # its (last) grant
    preemptible: bool = False  # may be asked to step aside (`Ask.preemptible`, until `Kept`)
    ask_again_at: float = 0.0  # `Kept.for_now`: not asked again before then
    preempting: bool = False  # asked to step aside; its leg not yet off its engine
    preempted: int = 0  # times it stepped aside
    stepped_for: int = 0  # the priority of the request it last stepped aside for
    resuming: tuple[int, int] | None = None  # stepped aside: (rank, turn) to go on
