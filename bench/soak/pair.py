"""Two `narwhal-serve` processes sharing a `file` lease and one handoff file: `a` starts as the
active, `b` as its warm standby. A killed router is restarted with `--standby` behind the one
that took over, so the pair always has a standby again."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench import web
from bench.procs import Proc, free_port, spawn
from bench.routers import Engines, RouterSpec, narwhal_config

# Fast enough that a takeover fits a 60 s run; the bounds are docs/lease.md's formulas.
TIMINGS: dict[str, dict[str, Any]] = {
    "controller": {"monitor_interval_s": 0.5, "monitor_failure_limit": 3},
    "engine": {"health_timeout_s": 0.5, "probe_timeout_s": 2.0},
    "lease": {"ttl_s": 2.0, "renew_interval_s": 0.4},
}


@dataclass(slots=True)
class Member:
    name: str  # "a" or "b"
    port: int
    config: Path
    log_dir: Path
    proc: Proc | None = None
    lives: int = 0  # how many times it was started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_name(self) -> str:
        return f"router-{self.name}-{self.lives}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.log_name}.log"


@dataclass(slots=True)
class Pair:
    members: dict[str, Member]
    handoff: Path
    request_timeout_s: float
    logs: list[tuple[str, Path]] = field(default_factory=list)  # (member, log) of every life

    @classmethod
    def plan(
        cls, engines: Engines, state: Path, log_dir: Path, policy: str, request_timeout_s: float
    ) -> Pair:
        handoff = state / "handoff" / "handoff.json"  # its own directory: the soak moves it
        lease = state / "lease" / "lease.json"
        handoff.parent.mkdir(parents=True, exist_ok=True)
        lease.parent.mkdir(parents=True, exist_ok=True)
        ports = {"a": free_port(), "b": free_port()}
        while ports["b"] == ports["a"]:
            ports["b"] = free_port()
        members = {}
        for name, other in (("a", "b"), ("b", "a")):
            spec = RouterSpec(f"soak-{name}", "narwhal", policy=policy, narwhal=TIMINGS)
            config = narwhal_config(spec, engines, ports[name], state)
            config["router_id"] = f"router-{name}"
            config["handoff"] = {"path": str(handoff)}
            config["lease"] = {"backend": "file", "path": str(lease), **TIMINGS["lease"]}
            config["standby"] = {"active_url": f"http://127.0.0.1:{ports[other]}"}
            config["serving"] |= {
                "request_timeout_s": request_timeout_s,
                "first_token_timeout_s": 3.0,
                "stream_idle_timeout_s": 2.0,
            }
            path = state / f"router-{name}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            members[name] = Member(name, ports[name], path, log_dir)
        return cls(members, handoff, request_timeout_s)

    def other(self, name: str) -> str:
        return "b" if name == "a" else "a"

    async def start(self, name: str, standby: bool) -> None:
        m = self.members[name]
        m.lives += 1
        argv = [sys.executable, "-m", "narwhal.cli.serve", "--config", str(m.config)]
        argv += ["--log-level", "INFO", "--log-format", "json"]
        if standby:
            argv.append("--standby")
        m.proc, _ = await spawn(m.log_name, argv, m.log_dir)
        self.logs.append((name, m.log))
        await web.wait_until(
            m.url + "/health", timeout_s=60, alive=lambda: m.proc is not None and m.proc.alive
        )

    async def start_pair(self) -> None:
        await self.start("a", standby=False)
        await web.wait_until(self.members["a"].url + "/ready", timeout_s=60)
        await self.start("b", standby=True)

    async def kill(self, name: str) -> None:
        m = self.members[name]
        if m.proc is not None:
            await m.proc.kill()
            m.proc = None

    def pid(self, name: str) -> int | None:
        proc = self.members[name].proc
        return proc.pid if proc is not None and proc.alive else None

    async def stop(self) -> None:
        for m in self.members.values():
            if m.proc is not None:
                await m.proc.stop()
                m.proc = None
