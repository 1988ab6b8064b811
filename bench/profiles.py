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


# A sample's step is the innermost Narwhal frame's module (what Narwhal code was running, or
# had called into a library, the event loop's C code or the kernel); first match wins. A
# sample with no Narwhal frame is the event loop's own work between callbacks.
STEPS = (
    ("parse and connection (HTTP/1 server)", ("narwhal/process/h1_", "narwhal/h1_body.py")),
    ("routing", ("narwhal/process/routes.py", "narwhal/process/forward.py")),
    (
        "validation (body, model, limits)",
        (
            "narwhal/dataplane/requests.py",
            "narwhal/dataplane/body.py",
            "narwhal/dataplane/tokens.py",
            "narwhal/dataplane/token_limits.py",
        ),
    ),
    ("auth", ("narwhal/dataplane/auth.py",)),
    (
        "admission (gate, flow)",
        (
            "narwhal/process/gate.py",
            "narwhal/dataplane/flow_gate.py",
            "narwhal/fleet/admission.py",
            "narwhal/flow/",
        ),
    ),
    (
        "placement",
        (
            "narwhal/dataplane/placement.py",
            "narwhal/dataplane/prefix.py",
            "narwhal/placement/",
            "narwhal/fleet/store.py",
            "narwhal/fleet/replica.py",
        ),
    ),
    ("shared tables (in-flight)", ("narwhal/process/table.py", "narwhal/fleet/inflight.py")),
    (
        "evidence and acknowledgements",
        (
            "narwhal/process/reporter.py",
            "narwhal/process/events.py",
            "narwhal/process/channel.py",
            "narwhal/fleet/evidence_sink.py",
        ),
    ),
    ("metrics", ("narwhal/telemetry/", "prometheus_client/")),
    ("access log", ("narwhal/dataplane/access_log.py",)),
    (
        "relay: engine legs (client side to engines)",
        (
            "narwhal/engine/",
            "narwhal/dataplane/legs.py",
            "narwhal/dataplane/leg.py",
            "narwhal/dataplane/engine_calls.py",
            "narwhal/dataplane/pool.py",
        ),
    ),
    (
        "relay: stream to the client",
        (
            "narwhal/dataplane/stream_leg.py",
            "narwhal/dataplane/relay.py",
            "narwhal/dataplane/sse.py",
            "narwhal/dataplane/watchdog.py",
            "narwhal/dataplane/exchange.py",
        ),
    ),
    ("request path (plane, ids, outcomes, record)", ("narwhal/dataplane/",)),
    (
        "control plane (monitor, fleet, state)",
        (
            "narwhal/control/",
            "narwhal/fleet/",
            "narwhal/state/",
            "narwhal/process/supervisor.py",
            "narwhal/process/worker.py",
        ),
    ),
    ("other Narwhal", ("narwhal/",)),
)
LOOP_STEP = "event loop (no Narwhal frame)"


# Frames that only start a process (its `main`, the worker spawner's fork): a sample under
# them and nothing else of Narwhal's is the event loop's own work.
_ENTRIES = (
    ("narwhal/cli/", None),
    ("narwhal/process/zygote.py", None),
    ("narwhal/process/worker.py", {"main", "_main"}),
)


def _entry(func: str, file: str) -> bool:
    return any(n in file and (fs is None or func in fs) for n, fs in _ENTRIES)


def step(frames: list[tuple[str, str]]) -> str:
    """The step of one sample, from its frames (function, file), outermost first."""
    for func, file in reversed(frames):
        if "narwhal/" not in file or _entry(func, file):
            continue
        for name, needles in STEPS:
            if any(n in file for n in needles):
                return name
    return LOOP_STEP


def steps(path: Path) -> dict[str, Any]:
    """Busy samples by step (shares of all busy samples) and their total."""
    counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        counts[step([_frame(f) for f in stack.split(";")])] += count
        total += count
    if not total:
        return {"samples": 0, "steps": []}
    return {"samples": total, "steps": [(k, v / total) for k, v in counts.most_common()]}
