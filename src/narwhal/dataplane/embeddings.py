"""`/v1/embeddings`: the client's body, as it is, to an embed engine of its model, no PD. Its
outcome is evidence like any leg's (`Legs.embed`); under `bounded` a failed attempt is
retried on another engine (an embedding has no side effects), as `policy.after_attempt`
says."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

from prometheus_client import Counter

from narwhal.clock import Clock
from narwhal.config import Role
from narwhal.dataplane.exchange import Answer, Exchange
from narwhal.dataplane.leg import Attempt, Leg
from narwhal.dataplane.outcomes import (
    DeadlineExceeded,
    NoCapacity,
    Saturated,
    bad_request,
    failure_response,
    reason,
    settled,
)
from narwhal.dataplane.policy import Limits, Next, Outcome, after_attempt
from narwhal.dataplane.requests import BadRequest, EmbeddingsRequest
from narwhal.engine.failures import ClientError, EngineFailure
from narwhal.fleet.state import EngineState
from narwhal.fleet.store import Fleet

Place = Callable[[Role, set[str], "str | None"], AbstractContextManager[EngineState]]
"""An engine for a role, in flight there while the block runs (`DataPlane._placed`)."""
Trace = Callable[[Exchange, Attempt, str, str], AbstractContextManager[None]]
"""A leg's span (`Spans.leg`)."""
NewLeg = Callable[[str, EngineState, Attempt, float, dict[str, Any]], Leg]
"""A leg with its engine's headers (`DataPlane._leg`)."""
Embed = Callable[[EmbeddingsRequest, Leg, float], Awaitable[Answer]]
"""One embed engine's answer, its evidence reported (`Legs.embed`)."""


class Embeddings:
    def __init__(
        self,
        fleet: Fleet,
        clock: Clock,
        place: Place,
        trace: Trace,
        new_leg: NewLeg,
        embed: Embed,
        retries: Counter,
    ) -> None:
        self._fleet = fleet
        self._clock = clock
        self._place = place
        self._trace = trace
        self._new_leg = new_leg
        self._embed = embed
        self._retries = retries  # by reason

    async def answer(
        self, req: EmbeddingsRequest, exchange: Exchange, deadline: float, limits: Limits
    ) -> Answer:
        """The embeddings, or the answer that ends the request: a 400 for a model that does
        not embed, the settling failure, or the last failure once the policy gives up."""
        if self._fleet.needed_roles(req.model) != (Role.EMBED,):
            message = f"The model `{req.model}` does not serve embeddings"
            refused = BadRequest(400, message, param="model", code="model_not_supported")
            return bad_request(refused)
        record = exchange.record
        assert record is not None  # `DataPlane.handle` made it
        tried: set[str] = set()
        number = 0
        while True:
            attempt = Attempt(record.next_attempt_id(), record.trace)
            try:
                with (
                    self._place(Role.EMBED, tried, req.model) as engine,
                    self._trace(exchange, attempt, "embed", engine.id),
                ):
                    record.prefill, record.decode = None, engine.id
                    leg = self._new_leg("embed", engine, attempt, deadline, {})
                    return await self._embed(req, leg, self._clock.monotonic())
            except (ClientError, NoCapacity, DeadlineExceeded) as exc:
                return settled(exc)
            except (EngineFailure, Saturated) as exc:
                last: Exception = exc
            now = self._clock.monotonic()
            if after_attempt(Outcome.RETRYABLE, number, limits, now, deadline) is not Next.RETRY:
                return failure_response(last)
            self._retries.labels(reason(last)).inc()
            number += 1
