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
    def load(
        self, states: Iterable[EngineState], gone: Iterable[str] = (), full: bool = False
    ) -> None:
        """Take the control process's states: the changed engines, and the members that left
        (`gone`), or a full snapshot, which also drops every engine it does not name. An
        engine new to this replica joins (its in-flight column is bound by the caller)."""
        listed = set()
        for state in states:
            listed.add(state.id)
            if not self.has(state.id):
                self.in_flight.add(state.id)
            self._engines[state.id] = state
        left = [e for e in self._engines if e not in listed] if full else list(gone)
        for engine_id in left:
            if self._engines.pop(engine_id, None) is not None:
                self.in_flight.remove(engine_id)

    def apply(self, event: Event, now: float) -> tuple[SuspectProbe, ...]:
        raise TypeError("a fleet replica is changed only by the control process's snapshots")
