"""A fleet of `narwhal-sim` engines on fixed loopback ports, with process-level faults."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import web
from bench.procs import Proc, free_port, spawn

_READY = r"narwhal-sim listening on (http://\S+)"
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True, slots=True)
class SimFlags:
    """Latency model and limits shared by every engine of a fleet."""

    itl_ms: float = 1.0
    ttft_per_token_ms: float = 0.05
    max_concurrency: int = 4096
    # more flags per role (the `cache` suite's prefix cache, queue and KV events)
    prefill_extra: tuple[str, ...] = ()
    decode_extra: tuple[str, ...] = ()

    def argv(self, role: str = "") -> list[str]:
        extra = {"prefill": self.prefill_extra, "decode": self.decode_extra}.get(role, ())
        return [
            "--itl-ms",
            str(self.itl_ms),
            "--ttft-per-token-ms",
            str(self.ttft_per_token_ms),
            "--max-concurrency",
            str(self.max_concurrency),
            *extra,
        ]


@dataclass(slots=True)
class Sim:
    name: str
    role: str
    port: int
    proc: Proc | None = None
    started: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(slots=True)
class SimFleet:
    model: str
    flags: SimFlags
    log_dir: Path
    sims: list[Sim] = field(default_factory=list)

    @classmethod
    def plan(
        cls, prefill: int, decode: int, model: str, flags: SimFlags, log_dir: Path
    ) -> SimFleet:
        fleet = cls(model, flags, log_dir)
        for role, n in (("prefill", prefill), ("decode", decode)):
            fleet.sims += [Sim(f"{role[0]}{i}", role, free_port()) for i in range(n)]
        return fleet

    def role(self, role: str) -> list[Sim]:
        return [s for s in self.sims if s.role == role]

    def get(self, name: str) -> Sim:
        return next(s for s in self.sims if s.name == name)

    async def start(self) -> None:
        await asyncio.gather(*(self.start_one(s) for s in self.sims if s.proc is None))

    async def start_one(self, sim: Sim) -> None:
        argv = [
            sys.executable,
            "-m",
            "narwhal.sim.cli",
            "serve",
            "--port",
            str(sim.port),
            "--role",
            sim.role,
            "--kv-role",
            KV_ROLE[sim.role],
            "--engine-id",
            sim.name,
            "--model",
            self.model,
            *self.flags.argv(sim.role),
        ]
        port_at = argv.index("--port") + 1
        for attempt in range(50):  # a killed sim's port may take a moment to free
            try:
                sim.proc, _ = await spawn(f"sim-{sim.name}", argv, self.log_dir, ready=_READY)
                sim.started = True
                return
            except RuntimeError:
                if attempt == 49:
                    raise
                if not sim.started:  # taken before we ever used it: take another one
                    sim.port = free_port()
                    argv[port_at] = str(sim.port)
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        await asyncio.gather(*(s.proc.stop() for s in self.sims if s.proc is not None))
        for s in self.sims:
            s.proc = None

    async def kill(self, name: str) -> None:
        sim = self.get(name)
        if sim.proc is not None:
            await sim.proc.kill()
            sim.proc = None

    def freeze(self, name: str, frozen: bool) -> None:
        proc = self.get(name).proc
        if proc is not None:
            proc.signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    async def add_fault(self, name: str, spec: dict[str, Any]) -> None:
        status, body = await web.call("POST", self.get(name).url + "/sim/faults", spec)
        if status != 201:
            raise RuntimeError(f"fault {spec} on {name}: HTTP {status} {body}")

    async def clear_faults(self, names: Sequence[str] | None = None) -> None:
        for sim in self.sims:
            if sim.proc is not None and (names is None or sim.name in names):
                await web.call("DELETE", sim.url + "/sim/faults")
