"""The ids the data plane gives engine requests: `narwhal-<random>-<n>`.

The random part is drawn once per process start (by the control process for each worker it
starts), so ids stay unique across restarts, workers and routers sharing engines, without a
uuid4 (a getrandom system call) on every request.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable


def request_prefix() -> str:
    return f"narwhal-{uuid.uuid4().hex[:16]}"


def numbered_ids(prefix: str) -> Callable[[], str]:
    """`<prefix>-1`, `<prefix>-2`, ..."""
    ids = itertools.count(1)
    return lambda: f"{prefix}-{next(ids)}"
