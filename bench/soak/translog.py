"""What the routers' own JSON logs say: engine transitions (`from -> to (reason)`) and monitor
stage errors, with wall-clock `ts` turned into CLOCK_MONOTONIC by a measured offset."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.soak.invariants import Transition


def wall_to_mono() -> float:
    """Subtract from a wall-clock time to get the monotonic one (same machine, same moment)."""
    return time.time() - time.monotonic()


def events(log: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def transitions(logs: list[Path], offset: float) -> list[Transition]:
    out = []
    for log in logs:
        for ev in events(log):
            if "engine" in ev and "to" in ev and "from" in ev:
                out.append(Transition(float(ev["ts"]) - offset, str(ev["engine"]), str(ev["to"])))
    return sorted(out, key=lambda tr: tr.t)


def stage_errors(logs: list[Path], offset: float, stage: str) -> list[tuple[float, str]]:
    """(t, exception class) of every failed monitor stage `stage`."""
    out = []
    for log in logs:
        for ev in events(log):
            if ev.get("stage") == stage and "exception" in ev:
                out.append((float(ev["ts"]) - offset, str(ev["exception"])))
    return sorted(out)


def request_prefixes(logs: list[Path]) -> list[str]:
    """The request-id prefixes a router's processes logged as they started (a restarted
    worker logs a new one)."""
    return [str(ev["request_prefix"]) for log in logs for ev in events(log)
            if "request_prefix" in ev]  # fmt: skip
