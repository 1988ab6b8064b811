"""Operator actions from `/admin/engines/{id}/...`: drain, planned maintenance, readmit.

Each becomes one event to the fleet; planned maintenance first reads the generation running
now, and readmission first runs the verification pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from narwhal.clock import Clock
from narwhal.control.lifecycle import Lifecycle
from narwhal.control.readmission import Readmission
from narwhal.fleet.holds import HoldName
from narwhal.fleet.store import Fleet


class OperatorActions:
    def __init__(
        self, fleet: Fleet, lifecycle: Lifecycle, readmission: Readmission, clock: Clock
    ) -> None:
        self._fleet = fleet
        self._lifecycle = lifecycle
        self._readmission = readmission
        self._clock = clock

    def drain(self, engine_id: str, reason: str | None = None) -> None:
        self._lifecycle.hold(
            self._fleet.get(engine_id),
            HoldName.OPERATOR_DRAIN,
            _with_reason("operator request", reason),
            self._clock.monotonic(),
        )

    async def maintenance(self, engine_id: str, reason: str | None = None) -> None:
        """Drain and require a process strictly newer than the one running at request time.

        The baseline is read from the engine now (see `Readmission.current_generation`) and
        kept on the hold, so the handoff carries it through resume and takeover.
        """
        engine = self._fleet.get(engine_id)
        baseline = await self._readmission.current_generation(engine, self._clock.wall())
        self._lifecycle.hold(
            engine,
            HoldName.PLANNED_MAINTENANCE,
            _with_reason(f"planned maintenance at generation {baseline}", reason),
            self._clock.monotonic(),
            newer_than=baseline,
        )

    async def readmit(
        self,
        engine_id: str,
        reason: str | None = None,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Run the verification pipeline now; success readmits and clears drains. `on_step`
        hears each step's result as it comes."""
        engine = self._fleet.get(engine_id)
        hear = None if on_step is None else (lambda r: on_step(r.to_json()))
        results = await self._readmission.verify(engine, hear)
        if all(r.ok for r in results):
            self._lifecycle.readmit(
                engine,
                _with_reason("operator readmission verified", reason),
                self._clock.monotonic(),
                operator=True,
            )
        return [r.to_json() for r in results]


def _with_reason(what: str, operator_reason: str | None) -> str:
    """A hold or transition reason with the operator's own words, when given."""
    return f"{what}: {operator_reason}" if operator_reason else what
