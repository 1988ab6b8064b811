"""The shared lease: one serving owner at a time, with epochs and fencing.

A lease record names a holder, an epoch (raised on every acquisition) and an expiry on
the store's wall clock. Stores (file, etcd) only do compare-and-swap; the rules live in
`LeaseKeeper`, which the router consults on every admission:

- the holder renews every `renew_interval_s`; it judges its own lease on the local
  monotonic clock from the *start* of its last successful renewal, and fences itself at
  `renew_deadline_s` (< `ttl_s`), i.e. before any other router can consider it expired;
- seeing another holder (or a newer epoch) fences it at once;
- a router that preempts a live holder waits out the previous lease before admitting; the
  swap compares the whole record it read, so the lease it waits out is the one it replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from narwhal.clock import Clock
from narwhal.config import LeaseConfig

log = logging.getLogger("narwhal.lease")

FENCED_LINE = "fenced: lease lost"
"""A fenced router's `/ready` body, whatever the cause (DESIGN's example line)."""


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    holder: str | None
    epoch: int
    expires_at: float  # store wall clock

    def expired(self, wall_now: float) -> bool:
        return self.holder is None or wall_now >= self.expires_at

    def to_json(self) -> dict[str, Any]:
        return {"holder": self.holder, "epoch": self.epoch, "expires_at": self.expires_at}

    @staticmethod
    def from_json(data: dict[str, Any]) -> LeaseRecord:
        holder = data.get("holder")
        epoch = data.get("epoch")
        expires_at = data.get("expires_at")
        if not (holder is None or isinstance(holder, str)) or not isinstance(epoch, int):
            raise ValueError(f"malformed lease record: {data!r}")
        if not isinstance(expires_at, int | float):
            raise ValueError(f"malformed lease record: {data!r}")
        return LeaseRecord(holder, epoch, float(expires_at))


class StoreUnavailable(Exception):
    """The lease store could not be reached or answered nonsense."""


class LeaseStore(Protocol):
    """Compare-and-swap over one lease record and the handoff kept beside it."""

    async def read(self) -> LeaseRecord | None: ...

    async def swap(self, expected: LeaseRecord | None, record: LeaseRecord) -> bool:
        """Write `record` iff the stored record equals `expected` (None: no record).

        The whole record, not only the epoch: a renewal between the caller's read and this
        swap changes `expires_at`, and the caller must then not wait out the older expiry.
        """
        ...

    async def renew(self, holder: str, epoch: int, expires_at: float) -> bool:
        """Extend iff `holder` still holds `epoch`."""
        ...

    async def write_handoff(self, holder: str, epoch: int, data: bytes) -> bool:
        """Write the handoff iff `holder` still holds `epoch` (the fencing guard)."""
        ...

    async def read_handoff(self) -> bytes | None: ...

    async def close(self) -> None: ...


class Role(StrEnum):
    STANDBY = "standby"
    ACTIVE = "active"
    FENCED = "fenced"


@dataclass(frozen=True, slots=True)
class AdmissionWindow:
    """When the lease lets this router admit (monotonic seconds): never while `static` is
    set, else from `admit_after` until `fence_at` (the renew deadline)."""

    static: str | None
    fence_at: float | None
    admit_after: float


def lease_reason_at(window: AdmissionWindow, now: float) -> str | None:
    """The lease's admission reason at `now` (None: admit). Pure."""
    if window.static is not None:
        return window.static
    if window.fence_at is not None and now >= window.fence_at:
        return FENCED_LINE  # the role follows at the next renewal attempt
    if now < window.admit_after:
        return "standby: waiting out the previous lease"
    return None


class LeaseKeeper:
    """This router's view of the lease, and every decision about it (time is injected)."""

    def __init__(self, router_id: str, config: LeaseConfig, store: LeaseStore, clock: Clock):
        self.router_id = router_id
        self._cfg = config
        self.store = store
        self._clock = clock
        self.role = Role.STANDBY
        self.epoch: int | None = None
        self.last_seen: LeaseRecord | None = None
        self.fence_reason: str | None = None
        self.on_event: Callable[[str], None] | None = None  # the event timeline hears these
        # Told whenever `admission_window` changes (acquired, renewed, fenced): data-plane
        # workers judge by a copy of it, which must not wait for the next heartbeat (a
        # renewal heard late let a worker's copy run past its renew deadline: a holder
        # answering `fenced` for a moment while its lease was fine).
        self.on_window: Callable[[], None] | None = None
        self._renew_started: float | None = None  # monotonic start of last good renewal
        self._admit_after: float = 0.0  # monotonic: preemption waits out the old lease
        self.store_error: str | None = None
        # One store operation at a time from this router: a handoff write guarded by the
        # revision it read must not race this router's own renewal.
        self._lock = asyncio.Lock()

    # ---------------------------------------------------------------- views
    def admission_reason(self, now: float) -> str | None:
        """None when this router may admit now; else the `/ready` line. Every fenced case
        reads exactly `fenced: lease lost` (DESIGN's line); why is in `fence_reason`, the
        log and the operator refusals."""
        return lease_reason_at(self.admission_window(), now)

    def admission_window(self) -> AdmissionWindow:
        """The data `admission_reason` judges by, which a data-plane worker judges by too:
        the worker fences itself at the local expiry even if this process stops."""
        if self.role is Role.FENCED:
            return AdmissionWindow(FENCED_LINE, None, 0.0)
        if self.role is Role.STANDBY:
            holder = self.last_seen.holder if self.last_seen else None
            return AdmissionWindow(f"standby: lease held by {holder or 'nobody'}", None, 0.0)
        assert self._renew_started is not None
        fence_at = self._renew_started + self._cfg.effective_renew_deadline_s
        return AdmissionWindow(None, fence_at, self._admit_after)

    def time_left_s(self, now: float) -> float | None:
        """The holder: its local lease on the monotonic clock. A standby: the record's
        `expires_at` against this router's wall clock (what it judges expiry by). A fenced
        router: None (its own lease is over; the record it last saw may be stale)."""
        if self.role is Role.ACTIVE and self._renew_started is not None:
            return max(0.0, self._renew_started + self._cfg.ttl_s - now)
        seen = self.last_seen
        if self.role is Role.STANDBY and seen is not None and seen.holder is not None:
            return max(0.0, seen.expires_at - self._clock.wall())
        return None

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "backend": self._cfg.backend,
            "router_id": self.router_id,
            "role": self.role.value,
            "holder": self.last_seen.holder if self.last_seen else None,
            "epoch": self.last_seen.epoch if self.last_seen else None,
            "my_epoch": self.epoch,
            "time_left_s": self.time_left_s(now),
            "fence_reason": self.fence_reason,
            "store_error": self.store_error,
            "admitting": self.admission_reason(now) is None,
        }

    def handoff_lease(self) -> dict[str, Any] | None:
        if self.epoch is None:
            return None
        return {"backend": self._cfg.backend, "holder": self.router_id, "epoch": self.epoch}

    # ---------------------------------------------------------------- actions
    def _fence(self, reason: str) -> None:
        if self.role is not Role.FENCED:
            log.error(
                "lease: %s -> fenced (%s)",
                self.role.value,
                reason,
                extra={
                    "lease_event": "fenced",
                    "from": self.role.value,
                    "to": "fenced",
                    "reason": reason,
                    "holder": self.router_id,
                    "epoch": self.epoch,
                },
            )
            if self.on_event is not None:
                self.on_event(f"fenced: {reason}")
        self.role = Role.FENCED
        self.fence_reason = reason
        self._window_changed()

    def _window_changed(self) -> None:
        if self.on_window is not None:
            self.on_window()

    async def observe(self) -> LeaseRecord | None:
        try:
            record = await self.store.read()
        except StoreUnavailable as exc:
            self.store_error = str(exc)
            return self.last_seen
        self.store_error = None
        self.last_seen = record
        return record

    async def try_acquire(self, preempt: bool) -> bool:
        """Take the lease if it is free or expired, or (preempt) from a failing holder."""
        record = await self.observe()
        if self.store_error is not None:
            return False
        wall = self._clock.wall()
        live = record is not None and not record.expired(wall)
        if live and not preempt:
            return False
        epoch = record.epoch if record is not None else 0
        started = self._clock.monotonic()
        new = LeaseRecord(self.router_id, epoch + 1, wall + self._cfg.ttl_s)
        try:
            async with self._lock:
                # Swapped only if the record is still exactly the one read: then the holder's
                # last good renewal is the one that stamped `record.expires_at`.
                won = await self.store.swap(record, new)
        except StoreUnavailable as exc:
            self.store_error = str(exc)
            return False
        if not won:
            return False
        previous = f"{record.holder}@{record.epoch}" if record else "none"
        self.role = Role.ACTIVE
        self.epoch = new.epoch
        self.last_seen = new
        self.fence_reason = None
        self._renew_started = started
        # A live holder may admit until its own renew deadline, which lies before the expiry
        # stamped by that renewal (the record just replaced): wait out that expiry.
        self._admit_after = started + (record.expires_at - wall if live and record else 0.0)
        log.warning(
            "lease: acquired epoch %d (previous %s%s)",
            new.epoch,
            previous,
            ", preempted" if live else "",
            extra={
                "lease_event": "acquired",
                "holder": self.router_id,
                "epoch": new.epoch,
                "previous_holder": record.holder if record else None,
                "previous_epoch": record.epoch if record else None,
                "preempted": live,
            },
        )
        if self.on_event is not None:
            self.on_event(f"acquired epoch {new.epoch} (previous {previous})")
        self._window_changed()
        return True

    async def renew(self) -> None:
        """One renewal attempt; fences on another holder or a missed deadline."""
        if self.role is not Role.ACTIVE:
            return
        assert self.epoch is not None and self._renew_started is not None
        started = self._clock.monotonic()
        if started - self._renew_started >= self._cfg.effective_renew_deadline_s:
            self._fence("lease not renewed in time")
            return
        expires_at = self._clock.wall() + self._cfg.ttl_s
        try:
            async with self._lock:
                ok = await self.store.renew(self.router_id, self.epoch, expires_at)
        except StoreUnavailable as exc:
            self.store_error = str(exc)
            if (
                self._clock.monotonic() - self._renew_started
                >= self._cfg.effective_renew_deadline_s
            ):
                self._fence(f"lease store unreachable: {exc}")
            return
        self.store_error = None
        if ok:
            self._renew_started = started
            self.last_seen = LeaseRecord(self.router_id, self.epoch, expires_at)
            self._window_changed()
            return
        record = await self.observe()
        holder = record.holder if record else None
        self._fence(f"lease lost to {holder or 'nobody'}")

    def check_deadline(self, now: float) -> None:
        """Fence when the local lease ran past its renew deadline (called by loops)."""
        if (
            self.role is Role.ACTIVE
            and self._renew_started is not None
            and now - self._renew_started >= self._cfg.effective_renew_deadline_s
        ):
            self._fence("lease not renewed in time")

    async def write_handoff(self, data: bytes) -> bool:
        """The epoch-guarded handoff write; a refusal fences this router."""
        self.check_deadline(self._clock.monotonic())
        if self.role is not Role.ACTIVE or self.epoch is None:
            return False
        try:
            async with self._lock:
                ok = await self.store.write_handoff(self.router_id, self.epoch, data)
        except StoreUnavailable as exc:
            self.store_error = str(exc)
            raise
        if not ok:
            self._fence("handoff write refused by the epoch guard")
        return ok

    async def release(self) -> None:
        """Give the lease up on a clean shutdown so a standby takes over at once."""
        if self.role is Role.ACTIVE and self.epoch is not None:
            with contextlib.suppress(StoreUnavailable):
                await self.store.renew(self.router_id, self.epoch, self._clock.wall())
