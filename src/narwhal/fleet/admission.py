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

    def add_check(self, owner: str, check: Callable[[], str | None]) -> None:
        """A reason computed at every admission (e.g. the lease's local expiry)."""
        self._checks[owner] = check

    def close(self, owner: str, reason: str) -> None:
        self._closed[owner] = reason

    def open(self, owner: str) -> None:
        self._closed.pop(owner, None)

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
