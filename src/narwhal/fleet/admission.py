"""Admission: whether this router takes new requests, and the reasons it does not.

Several owners may close it (the monitor when degraded, the lease when standby or fenced);
it is open only when none does. Requests already in flight are never affected.
"""

from __future__ import annotations

from collections.abc import Callable


class Admission:
    def __init__(self) -> None:
        self._closed: dict[str, str] = {}
        self._checks: dict[str, Callable[[], str | None]] = {}
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, listener: Callable[[], None]) -> None:
        """Told whenever an owner closes or opens it (a check's reason is not a change)."""
        self._listeners.append(listener)

    def add_check(self, owner: str, check: Callable[[], str | None]) -> None:
        """A reason computed at every admission (e.g. the lease's local expiry)."""
        self._checks[owner] = check

    def close(self, owner: str, reason: str) -> None:
        if self._closed.get(owner) != reason:
            self._closed[owner] = reason
            self._changed()

    def open(self, owner: str) -> None:
        if self._closed.pop(owner, None) is not None:
            self._changed()

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def reason(self, owner: str) -> str | None:
        check = self._checks.get(owner)
        dynamic = check() if check is not None else None
        return dynamic or self._closed.get(owner)

    @property
    def admitting(self) -> bool:
        return self.closed_reason() is None

    def closed_reason(self) -> str | None:
        """One reason, by owner precedence: lease before monitor before anything else."""
        for owner in ("lease", "monitor", *self._closed, *self._checks):
            reason = self.reason(owner)
            if reason is not None:
                return reason
        return None
