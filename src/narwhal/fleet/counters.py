"""Durable counters: totals that survive restarts and takeovers through the handoff.

Monitor-failure counters are deliberately not here: a restart starts them fresh.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Counters:
    failures: Counter[tuple[str, str]] = field(default_factory=Counter)  # (engine, class)
    ejections: Counter[str] = field(default_factory=Counter)
    readmissions: Counter[str] = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        failures: dict[str, dict[str, int]] = {}
        for (engine, cls), n in sorted(self.failures.items()):
            failures.setdefault(engine, {})[cls] = n
        return {
            "failures": failures,
            "ejections": dict(sorted(self.ejections.items())),
            "readmissions": dict(sorted(self.readmissions.items())),
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.failures = Counter(
            {(e, c): n for e, by in data.get("failures", {}).items() for c, n in by.items()}
        )
        self.ejections = Counter(data.get("ejections", {}))
        self.readmissions = Counter(data.get("readmissions", {}))

    def forget(self, engine_id: str) -> None:
        """An engine left the fleet: its totals leave with it (the handoff lists members)."""
        for key in [k for k in self.failures if k[0] == engine_id]:
            del self.failures[key]
        self.ejections.pop(engine_id, None)
        self.readmissions.pop(engine_id, None)
