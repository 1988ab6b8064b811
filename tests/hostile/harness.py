"""The hostile suite's pieces: a router as a real process (so its memory and its event loop
are its own), the legitimate flow beside it, and what both report.

`RouterProcess` runs `narwhal-serve --config` with `serving.workers` set (`auto`: a control
process and one worker per CPU; `1`: one process) and learns its port from the log. Its
`rss_bytes` sums VmRSS over the process and its descendants, read from /proc. `Flow` runs
`tests.hostile.flow` beside it and reads its records per time window.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

READY = "narwhal listening on http://"


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.extend(int(c) for c in text.split())
    return found


def tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(_children(p))
    return pids


def rss_bytes(pid: int) -> int:
    """VmRSS of one process (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


class RouterProcess:
    """`narwhal-serve` in a process of its own, on a free loopback port."""

    def __init__(self, config: dict[str, Any], workdir: Path, mode: str) -> None:
        self.mode = mode
        self.workdir = workdir
        self.config_path = workdir / "narwhal.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "router.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.port = 0

    def start(self, env: dict[str, str], timeout_s: float = 30.0) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "narwhal.cli.serve", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**clean, **env},
            )
        deadline = time.monotonic() + timeout_s
        while True:  # polling the log with a deadline: the process says when it listens
            text = self.log_path.read_text(errors="replace")
            if READY in text:
                self.url = "http://" + text.split(READY, 1)[1].split()[0]
                self.port = int(self.url.rsplit(":", 1)[1])
                if self._ready():  # the workers listen once the start-up sweep is done
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the router did not start ({self.mode}):\n{text}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        assert self.proc is not None
        return tree(self.proc.pid)

    def rss_bytes(self) -> int:
        """The router's whole memory: the control process and every worker."""
        return sum(rss_bytes(p) for p in self.pids())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            self.proc.wait(5)


@dataclass(frozen=True)
class FlowStats:
    """The legitimate flow over one window."""

    count: int
    failures: list[str]
    p50_s: float
    p99_s: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Flow:
    """`tests.hostile.flow` against one router, until `stop`."""

    url: str
    path: Path
    proc: subprocess.Popen[bytes] | None = None
    lanes: int = field(default=2)

    def start(self) -> None:
        self.path.write_text("")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.hostile.flow", self.url, str(self.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=Path(__file__).resolve().parents[2],  # the checkout: `tests` is importable
        )

    def records(self) -> list[dict[str, Any]]:
        lines = self.path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def settled_after(self, t: float) -> bool:
        """Every lane finished a request started after `t`: all it started before is done."""
        latest: dict[int, float] = {}
        for r in self.records():
            latest[r["lane"]] = max(latest.get(r["lane"], 0.0), r["start"])
        return len(latest) == self.lanes and all(s > t for s in latest.values())

    def window(self, t0: float, t1: float) -> FlowStats:
        """The requests that ran during [t0, t1], and each lane's first one after it (a case
        shorter than the flow's pause still has requests to judge)."""
        records = self.records()
        chosen = [r for r in records if r["start"] + r["latency_s"] >= t0 and r["start"] <= t1]
        for lane in {r["lane"] for r in records}:
            later = [r for r in records if r["lane"] == lane and r["start"] > t1]
            if later:
                chosen.append(min(later, key=lambda r: r["start"]))
        return FlowStats(
            count=len(chosen),
            failures=[r["error"] for r in chosen if not r["ok"]],
            p50_s=percentile([r["latency_s"] for r in chosen], 0.50),
            p99_s=percentile([r["latency_s"] for r in chosen], 0.99),
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(35)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_sync(
    probe: Any, *, timeout_s: float, interval_s: float = 0.05, what: str = "condition"
) -> Any:
    """`tests.support.poll.eventually` for the sync fixtures: poll `probe` with a deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
