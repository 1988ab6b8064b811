"""A minimal engine that answers at once: `python -m bench.mock_engine --port P --model M`.

For measuring routers where they are the bottleneck (the router_wrk suite): one aiohttp app
that speaks just enough of vLLM's OpenAI server for Narwhal, vllm-router
(`--vllm-pd-disaggregation`) and sglang-router (`--pd-disaggregation`) to route through it, and
does as little as it can per request. No latency model, no KV store, no side channel: unlike
narwhal-sim, whose decode leg fetches the prompt's blocks from the prefill over TCP, a decode
leg here answers from the body alone.

- a prefill leg (`kv_transfer_params.do_remote_decode: true`, as Narwhal and vllm-router send
  it) gets `max_tokens` tokens as one JSON body carrying vLLM's NixlConnector handoff
  (`kv_transfer_params` with `do_remote_prefill: true` and the remote_* fields);
- anything else (a decode leg, or either of sglang-router's two legs, which carry SGLang's
  `bootstrap_*` fields and no `kv_transfer_params`, as narwhal-sim treats them) gets
  `max_tokens` tokens at once: SSE when `stream: true` (the usage chunk when
  `stream_options.include_usage`, then `data: [DONE]`), else one JSON body;
- `/health`, `/v1/models` (Narwhal's monitor requires the model listed), `/metrics` (static:
  `process_start_time_seconds`, which Narwhal reads as the engine's generation, and zero
  running/waiting requests for its load scrape) and the probes the peers may send
  (`/server_info`, `/model_info`, `/get_load`, `/version` and their aliases), all static;
- `/tokenize`, `/v1/completions/render`, `/v1/chat/completions/render`: 404, as an engine
  without them answers (vllm-router asks for them before each leg, then goes on);
- `/mock/stats`: how many requests it answered, by path and kind (`prefill`, `stream`, `json`
  for inference, `get` for the rest), so that what a router asks of its engines per client
  request can be read.

Every answer's bytes are built once per shape (API, token count, usage asked) and reused with
the request's id spliced in.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

from aiohttp import web

DEFAULT_MAX_TOKENS = 16
DONE = b"data: [DONE]\n\n"
_ID = "@@mock-id@@"
_ID_BYTES = _ID.encode()
_JSON = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def word(i: int) -> str:
    """The i-th generated token's text."""
    return f" w{i}"


def prompt_tokens(doc: dict[str, Any]) -> int:
    """Whitespace-separated words of the prompt (or of every chat message's content): the
    usage's prompt count; a list of token ids counts its items."""
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return len(prompt.split())
    if isinstance(prompt, list):
        return len(prompt)
    n = 0
    for m in doc.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += len(content.split())
    return n


def max_tokens(doc: dict[str, Any]) -> int:
    value = doc.get("max_tokens", doc.get("max_completion_tokens"))
    return value if isinstance(value, int) and value > 0 else DEFAULT_MAX_TOKENS


def is_prefill_leg(doc: dict[str, Any]) -> bool:
    """vLLM's NixlConnector prefill leg: keep the KV for a remote decode."""
    params = doc.get("kv_transfer_params")
    return (
        isinstance(params, dict)
        and params.get("do_remote_decode") is True
        and params.get("do_remote_prefill") is not True
    )


def wants_usage(doc: dict[str, Any]) -> bool:
    opts = doc.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


class Shapes:
    """Each answer's bytes with `_ID` where the request's id goes, built once per shape."""

    def __init__(self, model: str, created: int) -> None:
        self.model = model
        self.created = created
        self._streams: dict[tuple[bool, int], bytes] = {}
        self._bodies: dict[tuple[bool, int], bytes] = {}

    def _head(self, chat: bool, stream: bool) -> dict[str, Any]:
        obj = ("chat.completion" if chat else "text_completion") + (
            ".chunk" if chat and stream else ""
        )
        prefix = "chatcmpl-" if chat else "cmpl-"
        return {"id": prefix + _ID, "object": obj, "created": self.created, "model": self.model}

    def stream(self, chat: bool, n: int) -> bytes:
        """Every event of a streamed answer of `n` tokens, up to (not including) usage and
        [DONE]: chat's role event, then one event per token, the last with `finish_reason`."""
        key = (chat, n)
        if key not in self._streams:
            head = self._head(chat, stream=True)
            events = []
            if chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                role |= {"logprobs": None, "finish_reason": None}
                events.append(head | {"choices": [role]})
            for i in range(n):
                choice: dict[str, Any] = {"index": 0}
                if chat:
                    choice["delta"] = {"content": word(i)}
                else:
                    choice["text"] = word(i)
                last = i == n - 1
                choice |= {
                    "logprobs": None,
                    "finish_reason": "length" if last else None,
                    "stop_reason": None,
                }
                events.append(head | {"choices": [choice]})
            self._streams[key] = b"".join(b"data: " + _dumps(e) + b"\n\n" for e in events)
        return self._streams[key]

    def usage_event(self, chat: bool, prompt: int, n: int) -> bytes:
        chunk = self._head(chat, stream=True) | {"choices": [], "usage": usage(prompt, n)}
        return b"data: " + _dumps(chunk) + b"\n\n"

    def body(self, chat: bool, n: int) -> bytes:
        """A whole answer of `n` tokens, open where the top-level fields that vary (`usage`,
        `kv_transfer_params`) go: `body + _dumps(fields)[1:]` closes it."""
        key = (chat, n)
        if key not in self._bodies:
            text = "".join(word(i) for i in range(n))
            choice: dict[str, Any] = {"index": 0}
            if chat:
                choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
            else:
                choice["text"] = text
            choice |= {"logprobs": None, "finish_reason": "length", "stop_reason": None}
            doc = self._head(chat, stream=False) | {"choices": [choice]}
            encoded = _dumps(doc)
            self._bodies[key] = encoded[:-1] + b","
        return self._bodies[key]


def handoff(engine_id: str, request_id: str, port: int, blocks: int) -> dict[str, Any]:
    """The prefill's answer to a decode, shaped as vLLM's NixlConnector returns it."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(range(blocks)),
        "remote_request_id": request_id,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
    }


class MockEngine:
    """The handlers, over one served model name."""

    def __init__(self, model: str, port: int) -> None:
        self.model = model
        self.port = port
        self.engine_id = f"mock-{port}"
        created = int(time.time())
        self.shapes = Shapes(model, created)
        self._ids = itertools.count()
        card = {"id": model, "object": "model", "created": created, "owned_by": "vllm"}
        card |= {"root": model, "parent": None, "max_model_len": 1 << 20, "permission": []}
        self._models = _dumps({"object": "list", "data": [card]})
        self._metrics = (
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {time.time():.3f}\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{model}"}} 0.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{model}"}} 0.0\n'
        ).encode()
        info = {"model_path": model, "served_model_name": model, "tokenizer_path": model}
        info |= {"max_model_len": 1 << 20, "is_generation": True, "tp_size": 1}
        self._info = _dumps(info)
        self._load = _dumps({"running": 0, "waiting": 0, "num_reqs": 0, "num_waiting_reqs": 0})
        self._version = _dumps({"version": "0", "engine": "bench.mock_engine"})
        self._absent = _dumps({"error": {"message": "Not Found", "code": 404}})
        # "<path> <leg>" -> requests answered: what a router asks of the engine per request
        self.counts: dict[str, int] = {}

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/health", self._static(b"", None))
        r.add_get("/v1/models", self._static(self._models))
        r.add_get("/metrics", self._static(self._metrics, "text/plain; version=0.0.4"))
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            r.add_get(path, self._static(self._info))
        for path in ("/v1/loads", "/get_load"):
            r.add_get(path, self._static(self._load))
        r.add_get("/version", self._static(self._version))
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        # vllm-router asks for these before each leg; vLLM without them answers 404, as here
        # (cheaply, and counted: the engines' share of a router's work shows in /mock/stats)
        for path in ("/tokenize", "/v1/completions/render", "/v1/chat/completions/render"):
            r.add_post(path, self.absent)
        r.add_get("/mock/stats", self.stats)
        return app

    def _static(self, body: bytes, content_type: str | None = _JSON) -> Any:
        """A GET handler answering `body`, counted as `<path> get`."""
        headers = {"Content-Type": content_type} if content_type else None

        async def handler(request: web.Request) -> web.Response:
            self._count(request.path, "get")
            return web.Response(body=body, headers=headers)

        return handler

    async def absent(self, request: web.Request) -> web.Response:
        await request.read()
        self._count(request.path, "404")
        return web.Response(status=404, body=self._absent, content_type=_JSON)

    async def stats(self, request: web.Request) -> web.Response:
        """The inference requests answered so far, by path, leg and stream mode (`/v1/completions
        prefill`, `/v1/completions stream`, `/v1/completions json`)."""
        return web.Response(body=_dumps(self.counts), content_type=_JSON)

    def _count(self, path: str, kind: str) -> None:
        key = f"{path} {kind}"
        self.counts[key] = self.counts.get(key, 0) + 1

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            doc = json.loads(await request.read())
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            self._count(request.path, "bad")
            return web.Response(
                status=400,
                body=_dumps({"error": {"message": "the body is not a JSON object", "code": 400}}),
                content_type=_JSON,
            )
        rid = request.headers.get("X-Request-Id") or f"mock{next(self._ids)}"
        spliced = json.dumps(rid)[1:-1].encode()  # safe inside the JSON string it goes in
        n = max_tokens(doc)
        prompt = prompt_tokens(doc)
        prefill = is_prefill_leg(doc)
        stream = doc.get("stream") is True and not prefill
        self._count(request.path, "prefill" if prefill else "stream" if stream else "json")
        if stream:
            payload = self.shapes.stream(chat, n)
            if wants_usage(doc):
                payload += self.shapes.usage_event(chat, prompt, n)
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            await resp.write(payload.replace(_ID_BYTES, spliced) + DONE)
            await resp.write_eof()
            return resp
        extra: dict[str, Any] = {"usage": usage(prompt, n), "kv_transfer_params": None}
        if prefill:
            extra["kv_transfer_params"] = handoff(
                self.engine_id, rid, self.port, max(1, prompt // 16)
            )
        body = self.shapes.body(chat, n).replace(_ID_BYTES, spliced) + _dumps(extra)[1:]
        return web.Response(body=body, content_type=_JSON)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.mock_engine", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True, help="the served model's name")
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    engine = MockEngine(args.model, args.port)
    print(f"bench.mock_engine listening on http://{args.host}:{args.port}", flush=True)
    web.run_app(
        engine.app(), host=args.host, port=args.port, access_log=None, print=None, backlog=1024
    )


if __name__ == "__main__":
    main()
