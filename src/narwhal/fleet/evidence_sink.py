"""The seam through which the data plane and probes report leg outcomes."""

from __future__ import annotations

from typing import Protocol

from narwhal.engine.failures import EngineFailure, SuccessKind


class EvidenceSink(Protocol):
    def failure(self, engine_id: str, failure: EngineFailure, leg: str) -> None: ...

    def success(self, engine_id: str, kind: SuccessKind, leg: str) -> None: ...

    async def settled(self) -> None:
        """Return once every outcome reported so far has been applied (at once when they
        are applied as they are reported; a worker waits for the control process)."""
        ...
