"""Number formatting and Markdown tables."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# Targets that are not peer routers: the no-router limit, the HTTP stack's floor, Narwhal.
NOT_PEERS = ("direct", "floor", "narwhal")


def is_peer(target: str) -> bool:
    return target not in NOT_PEERS


def num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    v = float(value)
    if math.isnan(v):
        return "-"
    if abs(v) >= 1000 and digits <= 1:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def ratio(a: Any, b: Any) -> str:
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return "-"
    if math.isnan(x) or math.isnan(y) or y == 0:
        return "-"
    return f"{x / y:.2f}x"


def mb(kb: Any) -> str:
    try:
        v = float(kb)
    except (TypeError, ValueError):
        return "-"
    return "-" if math.isnan(v) or v <= 0 else f"{v / 1024:.1f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
