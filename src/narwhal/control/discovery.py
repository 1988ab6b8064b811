"""Discovery rounds (DESIGN §10): every `discovery.interval_s` the active router asks DNS and
reads the watched file, and turns each source's answer into membership changes of that
source's own engines (`dns`, `file`).

- A new engine is added (unverified until its first healthy answer).
- The same id at a new address is relocated: a rescheduled pod, a restarted process.
- An engine missing from the answer is kept for `discovery.grace_s` (a pod being replaced, a
  record not yet published), then drained and removed. It is never ejected for leaving.
- A source that fails (a DNS timeout or server failure, an unreadable or invalid file) changes
  nothing this round; the failure is logged and counted.

`with_grace` is the pure part. The first round runs at start, before `--resume` is judged:
with discovery, the configured fleet is the config's engines plus the first round's answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from narwhal.clock import Clock
from narwhal.config import DiscoveryConfig, EngineConfig
from narwhal.control.membership import Membership, MembershipConflict
from narwhal.discovery import dns, files
from narwhal.discovery.dns import DiscoveryFailed
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.discovery")


def with_grace(
    found: Sequence[EngineConfig],
    members: Sequence[EngineConfig],
    missing_since: Mapping[str, float],
    now: float,
    grace_s: float,
) -> tuple[list[EngineConfig], dict[str, float]]:
    """The engines a source wants now: what it found, plus its members missing from the
    answer for less than `grace_s` (as they were); and when each missing one was first
    missed. A member found again is no longer missing."""
    found_ids = {e.id for e in found}
    desired = list(found)
    missing: dict[str, float] = {}
    for member in members:
        if member.id in found_ids:
            continue
        since = missing_since.get(member.id, now)
        if now - since < grace_s:
            desired.append(member)
            missing[member.id] = since
    return desired, missing


class Discovery:
    def __init__(
        self,
        config: DiscoveryConfig,
        membership: Membership,
        metrics: Metrics,
        clock: Clock,
        is_active: Callable[[], bool],
    ) -> None:
        self._cfg = config
        self._membership = membership
        self._metrics = metrics
        self._clock = clock
        self._is_active = is_active
        self._resolver = dns.resolver(config.nameservers, config.timeout_s)
        self._missing: dict[str, dict[str, float]] = {"dns": {}, "file": {}}
        self._file: tuple[files.Stamp, list[EngineConfig]] | None = None
        self.errors: dict[str, str | None] = {}  # each source's last failure (None: fine)

    async def run(self) -> None:
        """Rounds every `interval_s` while this router leads (a standby follows the active's
        membership through the handoff instead)."""
        while True:
            await self._clock.sleep(self._cfg.interval_s)
            if self._is_active():
                await self.round()

    async def round(self) -> None:
        if self._cfg.dns:
            await self._source("dns", self._dns)
        if self._cfg.file is not None:
            await self._source("file", self._read_file)
        _honour_swallowed_cancel()

    async def _source(self, origin: str, find: Callable[[], Awaitable[list[EngineConfig]]]) -> None:
        try:
            found = await find()
        except DiscoveryFailed as exc:
            self._failed(origin, str(exc))
            return
        # A member's absence dates from the answer that showed it, not from the question: a
        # slow answer must not shorten the grace period.
        now = self._clock.monotonic()
        others = {e.id: e for e in self._membership.fleet if e.origin != origin}
        usable = [e for e in found if e.id not in others]
        for engine in found:
            if engine.id in others:
                log.warning(
                    "discovery (%s): %s is already a %s engine; not added",
                    origin, engine.id, others[engine.id].origin,
                )  # fmt: skip
        desired, self._missing[origin] = with_grace(
            usable,
            self._membership.members(origin),
            self._missing[origin],
            now,
            self._cfg.grace_s,
        )
        try:
            self._membership.apply(desired, origin)
        except MembershipConflict as exc:
            self._failed(origin, f"conflict: {exc}")
            return
        self.errors[origin] = None
        self._metrics.discovery_rounds.labels(origin, "ok").inc()
        self._metrics.discovered_engines.labels(origin).set(len(usable))

    def _failed(self, origin: str, why: str) -> None:
        if self.errors.get(origin) != why:
            log.error("discovery (%s) failed, nothing changed: %s", origin, why)
        self.errors[origin] = why
        self._metrics.discovery_rounds.labels(origin, "failed").inc()

    async def _dns(self) -> list[EngineConfig]:
        found: list[EngineConfig] = []
        for source in self._cfg.dns:  # any failure fails the round: nothing is judged gone
            found.extend(await dns.find(source, self._resolver))
        return found

    async def _read_file(self) -> list[EngineConfig]:
        path = Path(self._cfg.file or "")
        seen = await asyncio.to_thread(files.stamp, path)
        if self._file is None or self._file[0] != seen:
            self._file = (seen, await asyncio.to_thread(files.read, path))
        return self._file[1]


def _honour_swallowed_cancel() -> None:
    """Raise the cancellation a round swallowed. dnspython waits with `asyncio.wait_for`,
    which on Python 3.11 loses a cancellation that arrives as the DNS answer does (fixed in
    3.12); the request stays counted on the task. Unhonoured, the router's shutdown waited
    for this loop forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
