"""Summaries of py-spy's collapsed stacks: busy samples by step, and self time per function.

A line of `py-spy record --format raw --function` is `frame;frame;...;leaf COUNT`, outermost
first, each frame `function (file:line)`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _frame(text: str) -> tuple[str, str]:
    match = _FRAME.match(text.strip())
    if not match:
        return text.strip(), ""
    return match["func"], match["file"]


def _stacks(path: Path) -> Iterator[tuple[list[tuple[str, str]], int]]:
    """Each line's frames (function, file), outermost first, and its sample count."""
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            yield [_frame(f) for f in stack.split(";")], int(count_text)


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


def steps(path: Path, top: int = 10) -> dict[str, Any]:
    """Busy samples by step (shares of all busy samples), their total, and the `top`
    functions by self time (the leaf frame: where the CPU was, a C call included)."""
    counts: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    total = 0
    for frames, count in _stacks(path):
        counts[step(frames)] += count
        func, file = frames[-1]
        self_time[f"{func} ({file})"] += count
        total += count
    if not total:
        return {"samples": 0, "steps": [], "self": []}
    return {
        "samples": total,
        "steps": [(k, v / total) for k, v in counts.most_common()],
        "self": [(k, v / total) for k, v in self_time.most_common(top)],
    }
