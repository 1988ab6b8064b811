"""The last completion requests the engine received, for tests to inspect (`/sim/requests`).

Header names are lower-cased (HTTP header names are case-insensitive; lookups should not be).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from narwhal.sim.leg import Leg


class RequestLog:
    def __init__(self, size: int = 200) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=size)

    def record(self, path: str, headers: Mapping[str, str], body: Any, leg: Leg) -> None:
        self._entries.append(
            {
                "path": path,
                "headers": {k.lower(): v for k, v in headers.items()},
                "body": body,
                "leg": leg.value,
            }
        )

    def entries(self) -> list[dict[str, Any]]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
