"""Admission: whether this router takes new requests, and the reasons it does not.

Several owners may close it (the monitor when degraded, the lease when standby or fenced);
it is open only when none does. Requests already in flight are never affected.
"""

from __future__ import annotations


class Admission:
    def __init__(self) -> None:
        self._closed: dict[str, str] = {}

    def close(self, owner: str, reason: str) -> None:
        self._closed[owner] = reason

    def open(self, owner: str) -> None:
        self._closed.pop(owner, None)

    def reason(self, owner: str) -> str | None:
        return self._closed.get(owner)

    @property
    def admitting(self) -> bool:
        return not self._closed

    def closed_reason(self) -> str | None:
        """One reason, by owner precedence: lease before monitor before anything else."""
        for owner in ("lease", "monitor"):
            if owner in self._closed:
                return self._closed[owner]
        return next(iter(self._closed.values()), None)
