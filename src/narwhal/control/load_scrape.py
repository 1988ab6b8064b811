"""Engine load for placement (DESIGN §11): every `placement.metrics_interval_s`, each
generative engine's `/metrics` on the control pool, parsed to its waiting and running requests
and KV usage, and handed to the data plane (`publish`: this process's, and with workers each
worker's through the channel).

Load only orders engines; it never judges one. A failed or unreadable scrape leaves that
engine's last load to go stale (`placement.metrics_stale_s`), and is no evidence against it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from narwhal.clock import Clock
from narwhal.config import Role
from narwhal.engine.failures import EngineFailure
from narwhal.engine.transport import EngineClient, control_get
from narwhal.fleet.state import EngineState
from narwhal.placement.load import EngineLoad, parse_load

log = logging.getLogger("narwhal.placement")

Publish = Callable[[dict[str, EngineLoad]], None]


class LoadScraper:
    def __init__(
        self,
        fleet: Callable[[], Iterable[EngineState]],
        client: EngineClient,
        clock: Clock,
        interval_s: float,
        timeout_s: float,
        publish: Publish,
        wanted: Callable[[], bool],
    ) -> None:
        self._fleet = fleet
        self._wanted = wanted  # read each round: a reload may turn flow control on or off
        self._client = client
        self._clock = clock
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._publish = publish
        self.loads: dict[str, EngineLoad] = {}

    async def run(self) -> None:
        """Until cancelled: a scrape each interval while something wants the loads
        (placement by prefix, flow control), none while nothing does."""
        while True:
            if self._wanted():
                await self.scrape_once()
            await self._clock.sleep(self._interval_s)

    async def scrape_once(self) -> None:
        engines = [e for e in self._fleet() if e.role is not Role.EMBED and e.ejected is None]
        found = await asyncio.gather(*(self._one(e) for e in engines))
        present = {e.id for e in engines}
        loads = {k: v for k, v in self.loads.items() if k in present}
        loads.update({e.id: load for e, load in zip(engines, found, strict=True) if load})
        self.loads = loads
        self._publish(loads)

    async def _one(self, engine: EngineState) -> EngineLoad | None:
        try:
            reply = await control_get(self._client, engine.config, "/metrics", self._timeout_s)
        except EngineFailure as exc:
            log.debug("load scrape: %s: %s", engine.id, exc.detail)
            return None
        if reply.status != 200:
            return None
        return parse_load(reply.body, self._clock.monotonic())
