"""An attempt and its legs: the values the request path passes instead of long signatures."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from narwhal.dataplane.migration import Splice
from narwhal.fleet.state import EngineState


@dataclass(slots=True, eq=False)  # hashed by identity: a key of `Moves`
class Attempt:
    """One prefill/decode attempt; `started` flips once this attempt sent the client bytes.
    `splice` follows a stream that may be migrated, across attempts."""

    request_id: str
    trace: Mapping[str, str]  # the client's trace context, for both legs
    started: bool = False
    handoff_failed: bool = False  # the decode refused the handoff or recomputed the prompt
    splice: Splice | None = None
    moved: str | None = None  # why it was moved off its decode engine (`moves.py`)


@dataclass(frozen=True, slots=True)
class Leg:
    """One engine's part of an attempt: which engine, what it is sent, by when.

    `name` is the leg's label in evidence and metrics (`prefill`, `decode`, `unified`,
    `embed`); `deadline` is the request's, on the router's clock; `producer` is the engine
    whose KV handoff a decode leg uses (charged when the decode shows it was unusable).
    """

    name: str
    engine: EngineState
    attempt: Attempt
    deadline: float
    headers: dict[str, Any]
    body: dict[str, Any]
    producer: EngineState | None = None

    def with_body(self, body: dict[str, Any]) -> Leg:
        """This leg sending `body` instead (a decode's, carrying the prefill's handoff).
        Built directly: `dataclasses.replace` costs a dozen calls on every request."""
        return Leg(
            self.name, self.engine, self.attempt, self.deadline, self.headers, body, self.producer
        )
