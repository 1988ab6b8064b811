"""Whether a prompt fits its model's context, before any leg is placed: `tokens.py` decides
from the prompt's size and a cache, and this module asks an engine of the model to count
(`POST /tokenize`) the few prompts near the limit. A count that fails lets the request go on:
the engine refuses what does not fit."""

from __future__ import annotations

from typing import Any

import orjson
from prometheus_client import Counter

from narwhal.clock import Clock
from narwhal.config import Config
from narwhal.dataplane.engine_calls import KeyOf, Post
from narwhal.dataplane.leg import Attempt
from narwhal.dataplane.placement import least_in_flight
from narwhal.dataplane.requests import ClientRequest
from narwhal.dataplane.tokens import TokenBudget
from narwhal.engine.failures import EngineFailure
from narwhal.engine.transport import PoolKind, engine_headers
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Children


class TokenLimits:
    """`config` is the one in force (replaced on reload): the default model and how long a
    count may take (`serving.first_token_timeout_s`, within the request's deadline)."""

    def __init__(
        self,
        fleet: Fleet,
        client: Post,
        clock: Clock,
        key_of: KeyOf,
        budget: TokenBudget,
        checks: Children[Counter],
        config: Config,
    ) -> None:
        self._fleet = fleet
        self._client = client
        self._clock = clock
        self._key_of = key_of
        self._budget = budget
        self._checks = checks  # by verdict
        self.config = config

    async def check(self, req: ClientRequest, deadline: float, attempt: Attempt) -> None:
        """Raise `BadRequest` (400) when the prompt cannot fit the smallest context of the
        model's engines (another model's context is not this one's)."""
        limits = [
            e.max_model_len
            for e in self._fleet
            if e.max_model_len is not None and e.serves_model(req.model)
        ]

        async def count(r: ClientRequest) -> int | None:
            return await self._count(r, deadline, attempt)

        result = await self._budget.check(req, min(limits) if limits else None, count)
        self._checks(result.verdict.value).inc()

    async def _count(self, req: ClientRequest, deadline: float, attempt: Attempt) -> int | None:
        """The prompt's token count by the least busy engine of its first role, or None."""
        role = self._fleet.needed_roles(req.model)[0]
        now = self._clock.monotonic()
        engine_id = least_in_flight(self._fleet.candidates(role, now, req.model), 0)
        if engine_id is None:
            return None
        body: dict[str, Any] = {"model": req.model or self.config.model}
        if req.endpoint == "chat":
            body["messages"] = req.body["messages"]
        else:
            body["prompt"] = req.body["prompt"]
        engine = self._fleet.get(engine_id).config
        timeout_s = min(self.config.serving.first_token_timeout_s, deadline - now)
        try:
            reply = await self._client.post(
                PoolKind.DATA,
                engine.url + "/tokenize",
                orjson.dumps(body),
                engine_headers(self._key_of(engine), attempt.request_id, attempt.trace),
                max(0.0, timeout_s),
            )
            if reply.status != 200:
                return None
            value = orjson.loads(reply.body).get("count")
            return value if isinstance(value, int) else None
        except (EngineFailure, orjson.JSONDecodeError, AttributeError):
            return None
