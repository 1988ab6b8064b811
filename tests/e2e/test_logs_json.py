"""`narwhal-serve --log-format json`: one JSON event per stderr line (docs/metrics.md, "Logs").

The router runs as a real process over engines on closed ports, so its health sweeps go
silent and liveness ejects both engines: the engine transitions (`engine X: from -> to
(reason)`), the lease acquisition and the start-up lines must all arrive as JSON objects with
`ts`, `level`, `logger` and `message`, and nothing else may be written to stderr. Events also
carry structured fields: transitions `engine`, `from`, `to`, `reason`; lease changes `epoch`
and `holder`; stage errors (a handoff path that is a directory) `stage` and `exception`.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.ports import closed_ports

LEVELS = {"debug", "info", "warning", "error", "critical"}
TRANSITION = re.compile(
    r"^engine (?P<id>\S+): (?P<before>\S+) -> (?P<after>\S+) \((?P<reason>.+)\)$"
)


def serve_command() -> list[str]:
    script = Path(sys.executable).with_name("narwhal-serve")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "narwhal.cli.serve"]


def write_config(tmp_path: Path, **overrides: Any) -> Path:
    p0, d0 = closed_ports(2)
    config = {
        "router_id": "json-logs",
        "listen": "127.0.0.1:0",
        "model": "demo-model",
        "engines": [
            {"id": "p0", "url": f"http://127.0.0.1:{p0}", "role": "prefill"},
            {"id": "d0", "url": f"http://127.0.0.1:{d0}", "role": "decode"},
        ],
        "controller": {"monitor_interval_s": 0.1},
        "engine": {"health_timeout_s": 0.3},
        # Liveness is the subject: connection streaks must not eject first.
        "recovery": {"liveness_misses": 2, "eject_after": 50},
        "handoff": {"path": str(tmp_path / "state" / "handoff.json")},
        "lease": {
            "backend": "file",
            "path": str(tmp_path / "state" / "lease.json"),
            "ttl_s": 10,
            "renew_interval_s": 2,
        },
    }
    config.update(overrides)
    path = tmp_path / "narwhal.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_router(config: Path, done: Any, cwd: Path) -> tuple[int, list[str]]:
    """Start `narwhal-serve --log-format json`, read stderr until `done`, stop it."""
    proc = subprocess.Popen(
        [*serve_command(), "--config", str(config), "--log-format", "json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=cwd,
    )
    try:
        lines = read_until(proc, done, timeout_s=20)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, lines + rest.decode().splitlines()


def read_until(proc: subprocess.Popen[bytes], done: Any, timeout_s: float) -> list[str]:
    """Read stderr lines until `done(lines)` or the timeout; never blocks past it."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    buf = b""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not done(lines):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *complete, buf = buf.split(b"\n")
        lines.extend(line.decode() for line in complete)
    if buf:
        lines.append(buf.decode())
    return lines


def parse(lines: list[str]) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"stderr line is not JSON: {line!r}")
        assert isinstance(event, dict), line
        events.append(event)
    return events


def transitions(events: list[dict[str, Any]]) -> list[re.Match[str]]:
    found = (TRANSITION.match(e.get("message", "")) for e in events)
    return [m for m in found if m]


def both_ejected(lines: list[str]) -> bool:
    ejected = {
        m["id"]
        for line in lines
        if line.startswith("{")
        for m in [TRANSITION.match(json.loads(line).get("message", ""))]
        if m and m["after"] == "ejected"
    }
    return ejected >= {"p0", "d0"}


def test_json_log_lines_include_engine_transitions(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    started = time.time()
    code, lines = run_router(config, both_ejected, tmp_path)
    assert code == 0

    events = parse(lines)
    assert events, "no log output at all"
    for event in events:
        assert {"ts", "level", "logger", "message"} <= set(event), event
        assert isinstance(event["ts"], float)
        assert started - 1 <= event["ts"] <= time.time() + 1
        assert event["level"] in LEVELS, event
        assert isinstance(event["logger"], str) and event["logger"], event
        assert isinstance(event["message"], str), event

    messages = [e["message"] for e in events]
    assert any(m.startswith("narwhal listening on http://127.0.0.1:") for m in messages)
    [acquired] = [
        e for e in events if "lease" in e["logger"] and "acquired epoch 1" in e["message"]
    ]
    assert acquired["epoch"] == 1
    assert acquired["holder"] == "json-logs"
    assert acquired["lease_event"] == "acquired"

    ejections = {m["id"]: m for m in transitions(events) if m["after"] == "ejected"}
    assert set(ejections) == {"p0", "d0"}, messages
    for m in ejections.values():
        assert m["before"] == "unverified"  # nothing listens: never seen healthy (DESIGN §10)
        assert m["reason"].startswith("ejected: liveness: 2 silent health sweeps")
    transition_events = [e for e in events if TRANSITION.match(e["message"])]
    assert {e["logger"] for e in transition_events} == {"narwhal.fleet"}
    assert {e["level"] for e in transition_events} == {"info"}
    for e in transition_events:
        m = TRANSITION.match(e["message"])
        assert m is not None
        assert (e["engine"], e["from"], e["to"], e["reason"]) == (
            m["id"],
            m["before"],
            m["after"],
            m["reason"],
        ), e


def handoff_stage_error(lines: list[str]) -> bool:
    return any(
        line.startswith("{") and json.loads(line).get("stage") == "handoff" for line in lines
    )


def test_a_stage_error_is_one_json_event_with_stage_and_exception(tmp_path: Path) -> None:
    # Once the router listens, its handoff path becomes a directory: every handoff write then
    # fails, a `handoff` stage error. (A directory there from the start is refused at start.)
    blocked = tmp_path / "state" / "handoff.json"
    blocked.parent.mkdir(parents=True)
    config = write_config(
        tmp_path,
        handoff={"path": str(blocked)},
        lease={"backend": "none"},
        recovery={"liveness_misses": 1000, "eject_after": 1000},
    )

    def block_then_wait(lines: list[str]) -> bool:
        if not blocked.is_dir() and any("listening on" in line for line in lines):
            blocked.unlink(missing_ok=True)
            blocked.mkdir()
        return handoff_stage_error(lines)

    code, lines = run_router(config, block_then_wait, tmp_path)
    assert code == 0
    errors = [e for e in parse(lines) if e.get("stage") is not None]
    assert errors, lines
    first = errors[0]
    assert first["stage"] == "handoff"
    assert first["exception"] == "IsADirectoryError"
    assert first["logger"] == "narwhal.monitor"
    assert first["level"] == "warning"
    assert first["message"].startswith("monitor stage handoff failed: IsADirectoryError")
    assert isinstance(first["detail"], str) and first["detail"]
