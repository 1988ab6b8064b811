"""`/tokenize` and `/detokenize` (vLLM's): the client's body, as it is, to one eligible engine
of the body's model, least busy first, no PD and no retry; the engine's answer is the
client's. `DataPlane.passthrough` authenticates and counts; this module forwards."""

from __future__ import annotations

from collections.abc import Callable

import orjson

from narwhal.clock import Clock
from narwhal.config import Config
from narwhal.dataplane.body import read_body
from narwhal.dataplane.engine_calls import KeyOf, Post
from narwhal.dataplane.errors import error_answer
from narwhal.dataplane.exchange import Answer, Exchange
from narwhal.dataplane.outcomes import bad_request
from narwhal.dataplane.placement import least_in_flight
from narwhal.dataplane.requests import BadRequest
from narwhal.engine.failures import EngineFailure
from narwhal.engine.transport import PoolKind, engine_headers
from narwhal.fleet.store import Fleet


class Passthrough:
    """`config` is the one in force (replaced on reload): the default model, the body limit
    and the engine's time to answer (`serving.first_token_timeout_s`)."""

    def __init__(
        self,
        fleet: Fleet,
        client: Post,
        clock: Clock,
        key_of: KeyOf,
        new_request_id: Callable[[], str],
        config: Config,
    ) -> None:
        self._fleet = fleet
        self._client = client
        self._clock = clock
        self._key_of = key_of
        self._new_id = new_request_id
        self.config = config

    async def answer(self, path: str, exchange: Exchange) -> Answer:
        """The engine's answer to `path` (`/tokenize` or `/detokenize`), or the router's 4xx
        or 5xx when the body, the model or the fleet does not allow one."""
        config = self.config
        try:
            raw = await read_body(exchange, config.serving.max_body_bytes)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
            model = body.get("model", config.model) if isinstance(body, dict) else None
            if not isinstance(model, str):
                raise BadRequest(400, "request body must be an object with a string 'model'")
            if not self._fleet.knows_model(model):
                raise BadRequest(
                    404, f"The model `{model}` does not exist.", param="model",
                    type_="NotFoundError", code="model_not_found",
                )  # fmt: skip
        except BadRequest as exc:
            return bad_request(exc)
        now = self._clock.monotonic()
        roles = self._fleet.needed_roles(model)
        candidates = [c for r in roles for c in self._fleet.candidates(r, now, model)]
        engine_id = least_in_flight(candidates, 0)
        if engine_id is None:
            return error_answer(
                503, f"no capacity: {model}", "service_unavailable", "no_capacity", retry_after_s=1
            )
        engine = self._fleet.get(engine_id).config
        headers = engine_headers(self._key_of(engine), self._new_id())
        try:
            reply = await self._client.post(
                PoolKind.DATA,
                engine.url + path,
                raw,
                headers,
                config.serving.first_token_timeout_s,
            )
        except EngineFailure as exc:
            return error_answer(502, f"upstream failure: {exc}", "upstream_error", "upstream_error")
        outcome = (
            "ok"
            if reply.status < 400
            else "client_error"
            if reply.status < 500
            else "upstream_error"
        )
        return Answer(reply.status, reply.body, reply.content_type, outcome)
