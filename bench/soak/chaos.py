"""Carries out a soak schedule in real time against the sims, the router pair and the handoff
directory, and records what each action did (for the report and the drain check)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench import web
from bench.sims import SimFleet
from bench.soak.pair import Pair
from bench.soak.schedule import Event
from bench.soak.watch import Watch

STALL_S = 15.0  # longer than every deadline: a stalled leg is the router's to give up on
SIM_FAULTS: dict[str, dict[str, Any]] = {
    "burst_5xx": {"kind": "completion_status", "status": 500},
    "handoff_garbage": {"kind": "handoff_garbage", "leg": "prefill"},
    "handoff_missing": {"kind": "handoff_missing", "leg": "prefill"},
    "stall_first_token": {"kind": "stall_first_token", "delay_s": STALL_S, "count": 4},
    "stall_mid_stream": {
        "kind": "stall_mid_stream",
        "after_tokens": 2,
        "delay_s": STALL_S,
        "count": 4,
        "leg": "decode",
    },
    "no_done": {"kind": "no_done", "leg": "decode"},
}
TAKEOVER_BOUND_S = 15.0  # generous: docs/lease.md's bound for these timings is ~3 s


@dataclass(slots=True)
class Chaos:
    fleet: SimFleet
    t0: float  # time.monotonic() of the schedule's zero
    pair: Pair | None = None  # None: a peer router, engine faults only
    watch: Watch | None = None
    drain_grace_s: float = 1.5  # a drain this old must be in the handoff (3 monitor passes)
    done: list[dict[str, Any]] = field(default_factory=list)
    drained: dict[str, float] = field(default_factory=dict)  # engine -> when the drain was acked
    drain_checks: list[tuple[float, str, bool]] = field(default_factory=list)
    takeovers: list[dict[str, Any]] = field(default_factory=list)
    dir_faults: list[tuple[float, float]] = field(default_factory=list)
    _operator: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def run(self, events: list[Event]) -> None:
        await asyncio.gather(*(self._one(e) for e in events))

    def _note(self, event: Event, what: str, **extra: Any) -> None:
        t = round(time.monotonic() - self.t0, 2)
        self.done.append(
            {"t": t, "kind": event.kind, "engine": event.engine, "what": what, **extra}
        )

    async def _one(self, e: Event) -> None:
        await asyncio.sleep(max(0.0, self.t0 + e.t - time.monotonic()))
        try:
            await getattr(self, f"_begin_{e.kind}" if e.kind not in SIM_FAULTS else "_begin_sim")(e)
            await asyncio.sleep(max(0.0, self.t0 + e.end - time.monotonic()))
            end = getattr(self, f"_end_{e.kind}", None) or self._end_sim
            await end(e)
        except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as exc:
            self._note(e, f"action failed: {type(exc).__name__}: {exc}"[:300], failed=True)

    # ------------------------------------------------------------------ engines
    async def _begin_sim(self, e: Event) -> None:
        assert e.engine is not None
        await self.fleet.add_fault(e.engine, SIM_FAULTS[e.kind])
        self._note(e, f"fault {SIM_FAULTS[e.kind]['kind']} for {e.duration_s} s")

    async def _end_sim(self, e: Event) -> None:
        if e.engine is not None and e.kind in SIM_FAULTS:
            await self.fleet.clear_faults([e.engine])

    async def _begin_engine_kill(self, e: Event) -> None:
        assert e.engine is not None
        await self.fleet.kill(e.engine)
        self._note(e, f"SIGKILL, restart in {e.duration_s} s")

    async def _end_engine_kill(self, e: Event) -> None:
        assert e.engine is not None
        await self.fleet.start_one(self.fleet.get(e.engine))

    async def _begin_engine_freeze(self, e: Event) -> None:
        assert e.engine is not None
        self.fleet.freeze(e.engine, True)
        self._note(e, f"SIGSTOP for {e.duration_s} s")

    async def _end_engine_freeze(self, e: Event) -> None:
        assert e.engine is not None
        self.fleet.freeze(e.engine, False)

    # ------------------------------------------------------------------ operator
    async def _admin(self, path: str, reason: str, tries: int = 20) -> tuple[int, Any]:
        """POST to the active router's admin API, retrying across a takeover (bounded)."""
        assert self.pair is not None and self.watch is not None
        status: int = 0
        body: Any = None
        for _ in range(tries):
            name = self.watch.active()
            if name is not None:
                url = self.pair.members[name].url + path
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    status, body = await web.call("POST", url, {"reason": reason}, timeout_s=5.0)
                    if status == 200:
                        return status, body
            await asyncio.sleep(0.25)
        return status, body

    async def _begin_drain(self, e: Event) -> None:
        async with self._operator:
            status, _ = await self._admin(f"/admin/engines/{e.engine}/drain", "soak drain")
            if status == 200 and e.engine is not None:
                self.drained[e.engine] = time.monotonic()
        self._note(e, f"operator drain: HTTP {status}")

    async def _end_drain(self, e: Event) -> None:
        async with self._operator:
            status, body = await self._admin(f"/admin/engines/{e.engine}/readmit", "soak readmit")
            if status == 200 and e.engine is not None:
                self.drained.pop(e.engine, None)
        self._note(e, f"operator readmit: HTTP {status}", detail=str(body)[:200])

    async def _begin_maintenance(self, e: Event) -> None:
        async with self._operator:
            status, _ = await self._admin(f"/admin/engines/{e.engine}/maintenance", "soak upgrade")
        self._note(e, f"planned maintenance: HTTP {status}; engine restarted in {e.duration_s} s")

    async def _end_maintenance(self, e: Event) -> None:
        assert e.engine is not None
        await self.fleet.kill(e.engine)  # the upgrade: a newer process on the same port
        await self.fleet.start_one(self.fleet.get(e.engine))

    # ------------------------------------------------------------------ router
    async def _begin_handoff_dir(self, e: Event) -> None:
        assert self.pair is not None and self.watch is not None
        directory = self.pair.handoff.parent
        away = directory.with_name(directory.name + ".away")
        self.watch.away = True
        directory.rename(away)
        directory.write_text("not a directory: the soak moved the handoff directory away\n")
        self.dir_faults.append((time.monotonic(), time.monotonic() + e.duration_s))
        self._note(e, f"handoff directory replaced by a file for {e.duration_s} s")

    async def _end_handoff_dir(self, e: Event) -> None:
        assert self.pair is not None and self.watch is not None
        directory = self.pair.handoff.parent
        directory.unlink()
        directory.with_name(directory.name + ".away").rename(directory)
        self.watch.away = False
        if self.dir_faults:
            self.dir_faults[-1] = (self.dir_faults[-1][0], time.monotonic())

    async def _begin_router_kill(self, e: Event) -> None:
        assert self.pair is not None and self.watch is not None
        async with self._operator:
            # Kill the router that serves: when none does at this moment (a fault of the
            # schedule's, such as the handoff directory's, can hold the active one unready for
            # a while), wait for it, within the takeover bound.
            victim = self.watch.active()
            deadline = time.monotonic() + TAKEOVER_BOUND_S
            while victim is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                victim = self.watch.active()
            if victim is None:
                self._note(e, "skipped: no router answered /ready 200", failed=True)
                return
            heir = self.pair.other(victim)
            t_kill = time.monotonic()
            await self.pair.kill(victim)
            url = self.pair.members[heir].url
            await web.wait_until(url + "/ready", timeout_s=TAKEOVER_BOUND_S)
            took = time.monotonic() - t_kill
            _, engines = await web.call("GET", url + "/admin/engines", timeout_s=5.0)
            holds = {x["id"]: x["holds"] for x in engines["engines"]}
            now = time.monotonic()
            for engine, acked in self.drained.items():
                if now - acked >= self.drain_grace_s:
                    self.drain_checks.append((now, engine, "operator_drain" in holds[engine]))
            await self.pair.start(victim, standby=True)
            self.takeovers.append({"t": round(t_kill - self.t0, 2), "t_mono": t_kill,
                                   "killed": victim, "heir": heir,
                                   "takeover_s": round(took, 2)})  # fmt: skip
            self._note(e, f"router {victim} SIGKILLed; {heir} ready after {took:.2f} s")


def remove_away(pair: Pair) -> None:
    """Put the handoff directory back if a run ended in the middle of that fault."""
    directory = pair.handoff.parent
    away = directory.with_name(directory.name + ".away")
    if away.exists():
        if directory.is_file():
            directory.unlink()
        elif directory.is_dir():
            shutil.rmtree(directory)
        away.rename(directory)
