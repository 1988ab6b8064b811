"""The fault scenarios: which engine, how the fault starts and ends, and how fast a router that
follows Narwhal's rules could notice it (`detect_s`, for the out-of-rotation budget)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bench.sims import SimFleet

Action = Callable[[SimFleet, str], Awaitable[None]]


async def _kill(fleet: SimFleet, name: str) -> None:
    await fleet.kill(name)


async def _restart(fleet: SimFleet, name: str) -> None:
    await fleet.start_one(fleet.get(name))


async def _freeze(fleet: SimFleet, name: str) -> None:
    fleet.freeze(name, True)


async def _thaw(fleet: SimFleet, name: str) -> None:
    fleet.freeze(name, False)


async def _clear(fleet: SimFleet, name: str) -> None:
    await fleet.clear_faults([name])


def _fault(spec: dict[str, object]) -> Action:
    async def add(fleet: SimFleet, name: str) -> None:
        await fleet.add_fault(name, spec)

    return add


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    engine: str
    what: str
    begin: Action
    end: Action
    detect: str  # which Narwhal deadline turns one request at the engine into a failure


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "decode_killed",
            "d0",
            "decode engine d0 killed (SIGKILL), restarted on the same port when the fault ends",
            _kill,
            _restart,
            "none",
        ),
        Scenario(
            "prefill_5xx",
            "p0",
            "prefill engine p0 answers every completion with HTTP 500",
            _fault({"kind": "completion_status", "status": 500}),
            _clear,
            "none",
        ),
        Scenario(
            "stall_mid_stream",
            "d0",
            "decode engine d0 stops every stream after 2 tokens, for good "
            "(streams already stalled stay stalled after the fault ends)",
            _fault({"kind": "stall_mid_stream", "after_tokens": 2, "delay_s": None}),
            _clear,
            "stream_idle_timeout_s",
        ),
        Scenario(
            "handoff_garbage",
            "p0",
            "prefill engine p0 returns kv_transfer_params with wrong types",
            _fault({"kind": "handoff_garbage"}),
            _clear,
            "none",
        ),
        Scenario(
            "frozen",
            "d0",
            "decode engine d0 frozen (SIGSTOP), thawed (SIGCONT) when the fault ends",
            _freeze,
            _thaw,
            "health_timeout_s",
        ),
    )
}
