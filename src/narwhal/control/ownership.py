"""Serving ownership: lease renewal while active, following and takeover while standby.

The active renews every `lease.renew_interval_s`. A standby (or a fenced router) re-reads
the active's handoff each interval and applies it (ignoring older epochs), counts the
active's failing `/ready` toward `standby.takeover_threshold`, and takes the lease when it
expired or at the threshold. Work that only the holder may do (`leadership`, e.g. etcd
compaction) runs in a scope opened on becoming active and cancelled on fencing or shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import aiohttp

from narwhal.clock import Clock
from narwhal.config import Config
from narwhal.control.membership import Membership, MembershipConflict
from narwhal.fleet.store import Fleet
from narwhal.state.handoff import (
    HandoffWriter,
    apply_document,
    check_document,
    load_schema,
    members_of,
)
from narwhal.state.lease import LeaseKeeper, Role
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.ownership")


ReadyProbe = Callable[[str], Awaitable[tuple[int, str] | None]]
"""GET `<url>/ready`: (status, body), or None when the active did not answer in time."""

Leadership = Callable[[], Coroutine[Any, Any, None]]
"""Work that runs only while this router holds the lease (it must not raise)."""


def counts_toward_takeover(ready_body: str) -> bool:
    """Which failing `/ready` answers are evidence against the active.

    Its own monitor degraded (or any reason we do not know) counts. A peer that says it is a
    standby or fenced is not the active, so its 503 says nothing about the active (counting
    it made two routers take the lease from each other forever); "no capacity" and
    "starting" (no engine of a role verified yet, e.g. vLLM still loading in a rollout) are
    the fleet's state, which a takeover would not change: the heir would say the same.
    """
    return not ready_body.startswith(("standby:", "fenced:", "no capacity:", "starting:"))


class Ownership:
    def __init__(
        self,
        config: Config,
        keeper: LeaseKeeper,
        fleet: Fleet,
        handoff: HandoffWriter,
        metrics: Metrics,
        clock: Clock,
        probe_ready: ReadyProbe | None = None,
        leadership: Sequence[Leadership] = (),
        membership: Membership | None = None,
    ) -> None:
        self._cfg = config
        self.keeper = keeper
        self._fleet = fleet
        self._handoff = handoff
        self._metrics = metrics
        self._clock = clock
        self._schema = load_schema()
        self.active_failures = 0
        self.followed: dict[str, Any] | None = None
        self.follow_error: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probe_ready = probe_ready or self._http_ready
        self._leadership = tuple(leadership)
        self._membership = membership  # a standby follows the active's membership too
        self._group: asyncio.TaskGroup | None = None
        self.leading: asyncio.Task[None] | None = None  # the leadership scope, while active
        self._scope: asyncio.TaskGroup | None = None  # its task group, once it runs

    async def start(self, standby: bool) -> None:
        """A non-standby router takes a free or expired lease at start; else it follows,
        and reads the lease so that /admin/lease names the holder from the first answer."""
        if not standby:
            await self.keeper.try_acquire(preempt=False)
        if self.keeper.role is not Role.ACTIVE:
            await self.keeper.observe()
            await self.follow()
        self._publish()

    def _publish(self) -> None:
        for role in Role:
            self._metrics.lease_role.labels(role.value).set(int(self.keeper.role is role))
        self._metrics.lease_epoch.set(self.keeper.epoch or 0)

    async def run(self) -> None:
        """Renew while active; follow and watch for takeover otherwise."""
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                while True:
                    self._scope_leadership()
                    if self.keeper.role is Role.ACTIVE:
                        await self.keeper.renew()
                        interval = self._cfg.lease.renew_interval_s
                    else:
                        await self.standby_step()
                        interval = self._cfg.controller.monitor_interval_s
                    self._scope_leadership()
                    self._publish()
                    await self._clock.sleep(interval)
        finally:
            self._group = self.leading = None
            if self._session is not None:
                await self._session.close()

    def _scope_leadership(self) -> None:
        """Open the leadership scope when this router is active, cancel it when it is not.
        Called right after every step that can change the role (renewal, acquisition, a
        handoff write refused by the epoch guard)."""
        active = self.keeper.role is Role.ACTIVE
        if active and self.leading is None and self._group is not None:
            self.leading = self._group.create_task(self._lead())
        elif not active and self.leading is not None:
            self.leading.cancel()
            self.leading = None

    async def _lead(self) -> None:
        """The leadership scope: the holder's own loops, and whatever `spawn` starts while it
        is open; it stays open until cancelled."""
        scope = asyncio.TaskGroup()
        try:
            async with scope:
                self._scope = scope
                for work in self._leadership:
                    scope.create_task(work())
                await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            if self._scope is scope:  # a later term may have opened its own already
                self._scope = None

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Start `work` in the leadership scope (fencing cancels it); None, with `work`
        closed unstarted, when this router is not leading."""
        if self._scope is None or self.keeper.role is not Role.ACTIVE:
            work.close()
            return None
        return self._scope.create_task(work)

    async def standby_step(self) -> None:
        await self.follow()
        await self._check_active()
        record = await self.keeper.observe()
        if self.keeper.store_error is not None:
            return
        expired = record is None or record.expired(self._clock.wall())
        threshold = self._cfg.standby.takeover_threshold
        if record is not None and record.holder == self.keeper.router_id and not expired:
            return  # our own old record: wait for it to expire rather than preempt ourselves
        if expired or self.active_failures >= threshold:
            won = await self.keeper.try_acquire(preempt=not expired)
            if won:
                self._metrics.lease_acquisitions.inc()
                self.active_failures = 0
                # Read the handoff one last time: the old holder may have written after our
                # last follow; the new epoch now refuses its writes, so this one is final.
                await self.follow()
                if self.followed is not None:
                    self._handoff.continue_from(self.followed)

    async def follow(self) -> None:
        """Apply the active's latest handoff, never one from an older epoch."""
        try:
            raw = await self.keeper.store.read_handoff()
        except Exception as exc:  # a store outage must not stop following later
            self.follow_error = f"{type(exc).__name__}: {exc}"
            return
        if raw is None:
            return
        verdict = check_document(
            raw,
            self._cfg,
            self._schema,
            now_wall_s=self._clock.wall(),
            membership=self._membership is not None,
        )
        if not verdict.ok or verdict.document is None:
            self.follow_error = verdict.reason
            return
        doc = verdict.document
        epoch = doc["writer"]["lease_epoch"] or 0
        if self.followed is not None:
            seen_epoch = self.followed["writer"]["lease_epoch"] or 0
            if (epoch, doc["sequence"]) <= (seen_epoch, self.followed["sequence"]):
                return  # older epoch, or nothing new
        if self._membership is not None:
            try:
                members = members_of(doc, self._cfg)
                self._membership.apply(
                    [c for c, _ in members], "handoff", origins={c.id: o for c, o in members}
                )
            except (MembershipConflict, ValueError) as exc:
                self.follow_error = f"membership: {exc}"
                return
        apply_document(doc, self._fleet, self._clock)
        self.followed = doc
        self.follow_error = None

    async def _check_active(self) -> None:
        url = self._cfg.standby.active_url
        if url is None:
            return
        answer = await self._probe_ready(url)
        if answer is None:
            failing, why = True, "unreachable"
        else:
            status, body = answer
            failing = status != 200 and counts_toward_takeover(body)
            why = f"HTTP {status}: {body.strip()[:200]}"
        before = self.active_failures
        self.active_failures = before + 1 if failing else 0
        # The climb to the takeover threshold, one line a check (an operator reads why the
        # standby took over, or nearly did); silent past the threshold.
        threshold = self._cfg.standby.takeover_threshold
        if failing and self.active_failures <= threshold:
            log.warning(
                "standby: the active failed its readiness check (%d of %d): %s",
                self.active_failures, threshold, why,
                extra={"active_failures": self.active_failures, "threshold": threshold},
            )  # fmt: skip
        elif not failing and before:
            log.info("standby: the active is ready again after %d failing checks", before)

    async def _http_ready(self, url: str) -> tuple[int, str] | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._cfg.engine.health_timeout_s)
            )
        try:
            async with self._session.get(url + "/ready") as resp:
                return resp.status, (await resp.read()).decode(errors="replace")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    def operator_refusal(self) -> str | None:
        """Why this router refuses an operator drain/maintenance/readmit, or None (active).

        A standby's or fenced router's change would be overwritten by the next handoff it
        follows, so it is refused with the active's name instead of silently lost."""
        role = self.keeper.role
        if role is Role.ACTIVE:
            return None
        seen = self.keeper.last_seen
        holder = seen.holder if seen is not None else None
        active = holder if holder and holder != self.keeper.router_id else "unknown"
        where = f"the active is {active}; send operator requests to it"
        if role is Role.FENCED:
            return f"fenced: {self.keeper.fence_reason}; {where}"
        return f"standby: {where}"

    async def write_handoff(self, doc: dict[str, Any], data: bytes) -> None:
        """The handoff stage's write: epoch-guarded; a fenced or standby router is silent."""
        if self.keeper.role is not Role.ACTIVE:
            return
        try:
            written = await self.keeper.write_handoff(data)
        finally:
            self._scope_leadership()  # a refused write fenced this router
        if written:
            if self._cfg.lease.backend == "etcd":
                await self._handoff.write_local(data)  # the local copy serves --resume
            self._handoff.accept(doc)

    def to_json(self) -> dict[str, Any]:
        out = self.keeper.to_json(self._clock.monotonic())
        out["active_failures"] = self.active_failures
        out["takeover_threshold"] = self._cfg.standby.takeover_threshold
        out["followed_sequence"] = self.followed["sequence"] if self.followed else None
        out["follow_error"] = self.follow_error
        return out
