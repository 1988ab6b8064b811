"""Summaries of py-spy's collapsed stacks: self and inclusive time per function and per area.

A line of `py-spy record --format raw --function` is `frame;frame;...;leaf COUNT`, outermost
first, each frame `function (file:line)`.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
AREAS = (
    ("narwhal dataplane", "narwhal/dataplane/"),
    ("narwhal engine transport", "narwhal/engine/"),
    ("narwhal telemetry (metrics)", "narwhal/telemetry/"),
    ("narwhal control", "narwhal/control/"),
    ("narwhal other", "narwhal/"),
    ("prometheus_client", "prometheus_client/"),
    ("aiohttp client", "aiohttp/client"),
    ("aiohttp server (web)", "aiohttp/web"),
    ("aiohttp other", "aiohttp/"),
    ("multidict / yarl", "multidict/"),
    ("multidict / yarl", "yarl/"),
    ("asyncio event loop", "asyncio/"),
    ("selectors / socket", "selectors.py"),
    ("json / orjson", "json/"),
    ("logging", "logging/"),
)


def _frame(text: str) -> tuple[str, str]:
    match = _FRAME.match(text.strip())
    if not match:
        return text.strip(), ""
    return match["func"], match["file"]


def area(file: str) -> str:
    for name, needle in AREAS:
        if needle in file:
            return name
    return "other (C code, stdlib)" if file else "other"


def summarise(path: Path, top: int = 15) -> dict[str, Any]:
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")]
        names = [f"{func} ({file})" for func, file in frames]
        total += count
        self_time[names[-1]] += count
        areas[area(frames[-1][1])] += count
        for name in set(names):
            inclusive[name] += count
    if not total:
        return {"samples": 0}

    def share(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(k, v / total) for k, v in counter.most_common(n)]

    narwhal_inclusive = Counter(
        {k: v for k, v in inclusive.items() if "narwhal/" in k and "narwhal/cli/" not in k}
    )
    return {
        "samples": total,
        "self": share(self_time, top),
        "inclusive_narwhal": share(narwhal_inclusive, top),
        "areas": share(areas, len(areas)),
    }
