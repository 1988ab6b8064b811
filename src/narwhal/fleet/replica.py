"""A worker's read-only copy of the control process's fleet (DESIGN §9).

It answers the same reads as `Fleet` (placement, `/ready`) over the states of the last
snapshot; only `load` changes it, and `apply` is refused: a worker reports outcomes to the
control process, whose reducer alone decides.
"""

from __future__ import annotations

from collections.abc import Iterable

from narwhal.fleet.events import Event, SuspectProbe
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet


class FleetReplica(Fleet):
    def load(self, states: Iterable[EngineState]) -> None:
        """Take the control process's states (a full snapshot or the changed engines)."""
        for state in states:
            if not self.has(state.id):
                raise KeyError(f"snapshot names unknown engine {state.id!r}")
            self._engines[state.id] = state

    def apply(self, event: Event, now: float) -> tuple[SuspectProbe, ...]:
        raise TypeError("a fleet replica is changed only by the control process's snapshots")
