"""The sim's HTTP surface: vLLM's endpoints, peer-router probes, and the `/sim/*` test API."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from narwhal import version
from narwhal.clock import Clock
from narwhal.sim.config import Role
from narwhal.sim.embeddings import EmbeddingsBody
from narwhal.sim.embeddings import answer as embeddings_answer
from narwhal.sim.engine import Outcome, SimEngine
from narwhal.sim.faults import Fault, FaultBook, FaultKind, FaultSpec
from narwhal.sim.kv_publisher import KvEventPublisher
from narwhal.sim.latency import Sleeper, pause
from narwhal.sim.leg import Leg, leg_of
from narwhal.sim.metrics import SimMetrics
from narwhal.sim.request_log import RequestLog
from narwhal.sim.requests import ChatBody, CompletionBody, RequestError, TokenizeBody, parse
from narwhal.sim.shapes import Envelope, dumps, error_body, response_body, usage
from narwhal.sim.streaming import StreamFaults, write_stream

_METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(body), status=status, content_type="application/json")


def error_response(err: RequestError) -> web.Response:
    return json_response(error_body(err.status, err.message, err.param), err.status)


class SimApp:
    """Route handlers over one engine; `apply_fault` performs a fault the API was given."""

    def __init__(
        self,
        engine: SimEngine,
        *,
        faults: FaultBook,
        metrics: SimMetrics,
        log: RequestLog,
        clock: Clock,
        sleeper: Sleeper,
        apply_fault: Callable[[FaultSpec], Fault],
        publisher: KvEventPublisher | None = None,
    ) -> None:
        self._engine = engine
        self._publisher = publisher
        self._config = engine.config
        self._faults = faults
        self._metrics = metrics
        self._log = log
        self._clock = clock
        self._sleeper = sleeper
        self._apply_fault = apply_fault

    def build(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/embeddings", self.embeddings)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/v1/loads", "/get_load"):
            r.add_get(path, self.load)
        r.add_get("/version", self.version)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_get("/sim/kv_events", self.kv_events)
        r.add_post("/sim/cache/match", self.cache_match)
        r.add_get("/sim/requests", self.list_requests)
        r.add_delete("/sim/requests", self.clear_requests)
        r.add_get("/sim/faults", self.list_faults)
        r.add_post("/sim/faults", self.add_fault)
        r.add_delete("/sim/faults", self.clear_faults)
        r.add_delete("/sim/faults/{fault_id}", self.remove_fault)
        return app

    def _model_name(self, leg: Leg | None = None) -> str:
        """The served model's name, or the one a `wrong_model` fault reports instead."""
        wrong = self._faults.fire(FaultKind.WRONG_MODEL, leg)
        return (wrong.spec.model or self._config.model) if wrong else self._config.model

    # --- vLLM's endpoints -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if hang := self._faults.fire(FaultKind.HEALTH_HANG):
            await pause(self._sleeper, hang.spec.delay_s)
        status = self._faults.fire(FaultKind.HEALTH_STATUS)
        return web.Response(status=(status.spec.status or 200) if status else 200)

    async def models(self, request: web.Request) -> web.Response:
        name = self._model_name()
        card = {
            "id": name,
            "object": "model",
            "created": int(self._engine.start_time),
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": self._config.max_model_len,
            "permission": [],
        }
        adapters = [
            {**card, "id": lora, "root": f"/adapters/{lora}", "parent": name}
            for lora in self._config.lora
        ]
        return json_response({"object": "list", "data": [card, *adapters]})

    async def metrics(self, request: web.Request) -> web.Response:
        if hang := self._faults.fire(FaultKind.METRICS_HANG):
            await pause(self._sleeper, hang.spec.delay_s)
        return web.Response(
            body=self._metrics.render(), headers={"Content-Type": _METRICS_CONTENT_TYPE}
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = parse(TokenizeBody, await _json(request))
            self._check_model(body.model)
            tokens = body.prompt_ids(self._engine.tokenizer)
        except RequestError as err:
            return error_response(err)
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": self._config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's shape (`{"tokens": [...]}` -> `{"prompt": ...}`). The default tokenizer's
        ids are hashes of words, so each id comes back as `<id>`."""
        try:
            doc = await _json(request)
            tokens = doc.get("tokens") if isinstance(doc, dict) else None
            self._check_model(doc.get("model") if isinstance(doc, dict) else None)
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise RequestError(400, "tokens must be a list of integers", "tokens")
        except RequestError as err:
            return error_response(err)
        return json_response({"prompt": self._engine.tokenizer.decode(tokens)})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=True)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._config.model and model not in self._config.lora:
            raise RequestError(404, f"The model `{model}` does not exist.", "model")

    async def _received(self, request: web.Request) -> tuple[Any, Leg, web.Response | None]:
        """A request for inference, recorded and counted: its body (None: not JSON), its leg,
        and the answer a connection or status fault gives instead, if one fires."""
        raw = await request.read()
        try:
            doc: Any = json.loads(raw)
        except ValueError:
            doc = None
        leg = leg_of(doc.get("kv_transfer_params") if isinstance(doc, dict) else None)
        recorded = raw.decode(errors="replace") if doc is None else doc
        self._log.record(request.path, request.headers, recorded, leg)
        self._metrics.count_request(leg)
        if self._faults.fire(FaultKind.RESET_CONNECTIONS, leg):
            return doc, leg, _reset(request)
        if status := self._faults.fire(FaultKind.COMPLETION_STATUS, leg):
            code = status.spec.status or 500
            return (
                doc,
                leg,
                error_response(RequestError(code, f"narwhal-sim injected status {code}")),
            )
        return doc, leg, None

    async def _completion(self, request: web.Request, chat: bool) -> web.StreamResponse:
        doc, leg, faulted = await self._received(request)
        if faulted is not None:
            return faulted
        try:
            if self._config.role is Role.EMBED:
                api = "Chat Completions" if chat else "Completions"
                raise RequestError(400, f"The model does not support {api} API")
            if not isinstance(doc, dict):
                raise RequestError(400, "the body is not a JSON object")
            with self._engine.admitted():
                return await self._generate(request, doc, chat, leg)
        except RequestError as err:
            return error_response(err)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """vLLM's `/v1/embeddings` for a pooling model (`--role embed`); faults act on it
        as on an unified leg."""
        doc, leg, faulted = await self._received(request)
        if faulted is not None:
            return faulted
        try:
            if self._config.role is not Role.EMBED:
                raise RequestError(400, "The model does not support Embeddings API")
            body = parse(EmbeddingsBody, doc)
            self._check_model(body.model)
            if stall := self._faults.fire(FaultKind.STALL_FIRST_TOKEN, leg):
                await pause(self._sleeper, stall.spec.delay_s)
            with self._engine.admitted():
                request_id = request.headers.get("X-Request-Id") or self._engine.new_id()
                created = int(self._clock.wall())
                return json_response(
                    embeddings_answer(body, self._model_name(leg), request_id, created)
                )
        except RequestError as err:
            return error_response(err)

    async def _generate(
        self, request: web.Request, doc: dict[str, Any], chat: bool, leg: Leg
    ) -> web.StreamResponse:
        body = parse(ChatBody, doc) if chat else parse(CompletionBody, doc)
        if body.n != 1:
            raise RequestError(400, "narwhal-sim supports only n=1", "n")
        self._check_model(body.model)
        slow = self._faults.fire(FaultKind.SLOW, leg)
        factor = (slow.spec.factor or 1.0) if slow else 1.0
        if stall := self._faults.fire(FaultKind.STALL_FIRST_TOKEN, leg):
            await pause(self._sleeper, stall.spec.delay_s)
        async with self._engine.complete(body, leg, factor) as outcome:
            return await self._answer(request, body, chat, leg, outcome)

    async def _answer(
        self,
        request: web.Request,
        body: CompletionBody | ChatBody,
        chat: bool,
        leg: Leg,
        outcome: Outcome,
    ) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or self._engine.new_id()
        env = Envelope(
            chat=chat,
            id=("chatcmpl-" if chat else "cmpl-") + request_id,
            created=int(self._clock.wall()),
            model=body.model if body.model in self._config.lora else self._model_name(leg),
            prompt_ids=outcome.prompt_ids
            if body.return_token_ids and self._config.token_ids
            else None,
        )
        if body.stream:
            return await write_stream(
                request, env, outcome, body.include_usage, self._stream_faults(leg), self._sleeper
            )
        generated = len(outcome.generated.indices)
        await pause(self._sleeper, outcome.itl_s * max(0, generated - 1))
        use = usage(outcome.prompt_tokens, generated, outcome.cached_tokens)
        return json_response(response_body(env, outcome.generated, use, outcome.extra))

    def _stream_faults(self, leg: Leg) -> StreamFaults:
        def after(kind: FaultKind) -> int | None:
            """Tokens sent before the fault acts (default 1); None: it does not fire."""
            fired = self._faults.fire(kind, leg)
            if fired is None:
                return None
            return 1 if fired.spec.after_tokens is None else fired.spec.after_tokens

        stall = self._faults.fire(FaultKind.STALL_MID_STREAM, leg)
        stall_after = None if stall is None else stall.spec.after_tokens
        return StreamFaults(
            stall_after_tokens=None if stall is None else 1 if stall_after is None else stall_after,
            stall_s=None if stall is None else stall.spec.delay_s,
            no_done=self._faults.fire(FaultKind.NO_DONE, leg) is not None,
            malformed_after=after(FaultKind.MALFORMED_EVENT),
            error_after=after(FaultKind.ERROR_EVENT),
        )

    # --- probes other routers send ----------------------------------------------------------

    async def server_info(self, request: web.Request) -> web.Response:
        c = self._config
        return json_response(
            {
                "model_path": c.model,
                "served_model_name": c.model,
                "max_model_len": c.max_model_len,
                "role": c.role.value,
                "kv_role": c.kv_role.value,
                "engine_id": c.engine_id,
                "tp_size": 1,
                "version": version(),
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        c = self._config
        return json_response(
            {
                "model_path": c.model,
                "tokenizer_path": c.model,
                "is_generation": c.role is not Role.EMBED,
                "max_model_len": c.max_model_len,
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        running, waiting = self._engine.running, self._engine.waiting
        return json_response(
            {
                "running": running,
                "waiting": waiting,
                "num_reqs": running,
                "num_waiting_reqs": waiting,
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's (dev-mode) endpoint: every cached block dropped, `AllBlocksCleared` sent."""
        if not self._engine.reset_prefix_cache():
            return error_response(RequestError(400, "narwhal-sim runs without a prefix cache"))
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": version(), "engine": "narwhal-sim"})

    # --- /sim: introspection and faults -----------------------------------------------------

    async def cache_match(self, request: web.Request) -> web.Response:
        """The engine's true cache for a completion or chat body (`messages`), unchanged:
        `{"prompt_tokens", "cached_tokens"}`. The benchmark's oracle router places by it."""
        try:
            doc = await _json(request)
            body: ChatBody | CompletionBody
            if isinstance(doc, dict) and "messages" in doc:
                body = parse(ChatBody, doc)
            else:
                body = parse(CompletionBody, doc)
            self._check_model(body.model)
            matched = self._engine.cached_prefix(body)
        except RequestError as err:
            return error_response(err)
        if matched is None:
            return error_response(RequestError(400, "narwhal-sim runs without a prefix cache"))
        return json_response({"prompt_tokens": matched[0], "cached_tokens": matched[1]})

    async def list_requests(self, request: web.Request) -> web.Response:
        return json_response(self._log.entries())

    async def clear_requests(self, request: web.Request) -> web.Response:
        self._log.clear()
        return web.Response(status=204)

    async def kv_events(self, request: web.Request) -> web.Response:
        """Where this engine publishes its KV events (ports chosen at start with 0 included)."""
        p = self._publisher
        if p is None:
            return error_response(RequestError(404, "narwhal-sim publishes no KV events"))
        host = self._config.advertised_host
        host = f"[{host}]" if ":" in host else host
        replay = None if p.replay_port is None else f"tcp://{host}:{p.replay_port}"
        return json_response(
            {
                "endpoint": f"tcp://{host}:{p.port}",
                "replay_endpoint": replay,
                "topic": p.config.topic,
                "encoding": p.config.encoding.value,
                "block_hash": p.config.hash_format.value,
                "next_sequence": p.next_sequence,
                "published": p.published,
                "dropped": p.dropped,
            }
        )

    async def list_faults(self, request: web.Request) -> web.Response:
        return json_response([f.to_json() for f in self._faults.snapshot()])

    async def add_fault(self, request: web.Request) -> web.Response:
        try:
            spec = FaultSpec.model_validate(await _json(request))
        except RequestError as err:
            return error_response(err)
        except ValidationError as exc:
            return error_response(RequestError(400, _validation_message(exc)))
        return json_response(self._apply_fault(spec).to_json(), status=201)

    async def clear_faults(self, request: web.Request) -> web.Response:
        self._faults.clear()
        return web.Response(status=204)

    async def remove_fault(self, request: web.Request) -> web.Response:
        fault_id = request.match_info["fault_id"]
        if fault_id.isdigit() and self._faults.remove(int(fault_id)):
            return web.Response(status=204)
        return error_response(RequestError(404, f"no fault {fault_id}"))


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except ValueError as exc:
        raise RequestError(400, f"the body is not valid JSON: {exc}") from exc


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'fault'}: {e['msg']}" for e in exc.errors()
    )


def _reset(request: web.Request) -> web.Response:
    """Drop the connection with a TCP reset; the returned response is never sent."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    return web.Response(status=500)
