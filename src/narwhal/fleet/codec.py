"""`EngineState` as plain JSON data, for the snapshots the control process sends its workers.

The engine's `config` is not sent: both sides built the same validated config, so the receiver
rebinds its own `EngineConfig` by id. Pure functions; `decode(encode(s), s.config) == s`.
"""

from __future__ import annotations

from typing import Any

from narwhal.config import EngineConfig, Role
from narwhal.engine.failures import FailureClass
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.state import Ejection, EngineState


def encode(state: EngineState) -> dict[str, Any]:
    ejected = state.ejected
    return {
        "id": state.id,
        "role": state.role.value,
        "evidence": {c.value: n for c, n in state.evidence.items()},
        "liveness_misses": state.liveness_misses,
        "ejected": None
        if ejected is None
        else [ejected.cause, ejected.reason, ejected.at_wall, dict(ejected.evidence)],
        "holds": {
            h.name.value: [h.reason, h.since_wall, h.deadline_mono, h.deadline_wall, h.newer_than]
            for h in state.holds.values()
        },
        "generation": state.generation,
        "max_model_len": state.max_model_len,
        "verified": state.verified,
        "unverified_reason": state.unverified_reason,
        "leaving": state.leaving,
        "origin": state.origin,
        "served": sorted(state.served),
        "adapters": sorted(state.adapters),
    }


def decode(data: dict[str, Any], config: EngineConfig) -> EngineState:
    ejected = data["ejected"]
    return EngineState(
        config=config,
        role=Role(data["role"]),
        evidence={FailureClass(c): n for c, n in data["evidence"].items()},
        liveness_misses=data["liveness_misses"],
        ejected=None if ejected is None else Ejection(*ejected),
        holds={
            HoldName(name): Hold(HoldName(name), *fields) for name, fields in data["holds"].items()
        },
        generation=data["generation"],
        max_model_len=data["max_model_len"],
        verified=data["verified"],
        unverified_reason=data["unverified_reason"],
        leaving=data["leaving"],
        origin=data["origin"],
        served=frozenset(data["served"]),
        adapters=frozenset(data["adapters"]),
    )
