"""Client request validation: bad input gets a precise OpenAI-style 4xx, never a 500."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from narwhal.engine.adapter import Endpoint
from narwhal.engine.vllm import strip_client_kv_params


class BadRequest(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ("not_found_error" if status == 404 else "invalid_request_error")
        self.code = code  # OpenAI's error code (`model_not_found`); None: the status


@dataclass(frozen=True, slots=True)
class ClientRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    prompt_text: str | None  # for token counting; None when the prompt is token ids
    prompt_token_count: int | None  # exact when the client sent token ids
    message_count: int
    model: str | None = None  # the model the client named (DESIGN §10: routed by it)
    n: int = 1  # choices per prompt; above 1, served as parts (dataplane/fanout.py)
    batch: tuple[Any, ...] | None = None  # a batched completions prompt, one entry per prompt


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _optional_positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise BadRequest(400, f"'{key}' must be a positive integer", param=key)
    return int(value)


MAX_CHOICES = 1024
"""The most choices (prompts times n) one request may ask for: each is a PD request of its own."""


def _prompt(body: dict[str, Any]) -> tuple[str | None, int | None, tuple[Any, ...] | None]:
    """The prompt's text or token count, or, for a batch, its prompts."""
    if "prompt" not in body:
        raise BadRequest(400, "'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return None, len(prompt), None
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0], None, None
        if len(prompt) == 1 and _token_ids(prompt[0]):
            return None, len(prompt[0]), None
        if all(isinstance(p, str) for p in prompt) or all(_token_ids(p) for p in prompt):
            return None, None, tuple(prompt)
    raise BadRequest(
        400,
        "'prompt' must be a string, a list of token ids, or a list of either",
        param="prompt",
    )


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _messages(body: dict[str, Any]) -> tuple[str, int]:
    if "messages" not in body:
        raise BadRequest(400, "'messages' is required", param="messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(
                400, f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]"
            )
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                400,
                f"messages[{i}].content must be a string or a list of parts",
                param=f"messages[{i}].content",
            )
    # Everything a chat template can render (messages with tool calls, tools, functions),
    # as JSON: its byte size bounds the prompt's token count from above.
    rendered = [messages, body.get("tools"), body.get("functions")]
    return orjson.dumps(rendered).decode(), len(messages)


def _object_with_model(raw: bytes, default_model: str) -> tuple[dict[str, Any], str]:
    """The body as a JSON object, and the model it names (`default_model` when none)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise BadRequest(400, "'model' must be a string", param="model")
    return body, model


def parse_request(endpoint: Endpoint, raw: bytes, default_model: str) -> ClientRequest:
    """Validate a client body; raises BadRequest with the status the client should get. A
    body without `model` asks for `default_model`; whether a model is served is the fleet's
    to say."""
    body, model = _object_with_model(raw, default_model)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(400, "'stream_options' must be an object", param="stream_options")
    n = 1 if body.get("n") is None else body["n"]
    if not _is_int(n) or n < 1:
        raise BadRequest(400, "'n' must be a positive integer", param="n")
    if n > 1 and stream:
        raise BadRequest(
            400, "n > 1 is served only without stream (each choice is its own PD request)",
            param="n",
        )  # fmt: skip
    # Prompt logprobs are the prefill's, and a disaggregated decode does not compute them.
    if body.get("prompt_logprobs") is not None:
        raise BadRequest(
            400, "prompt_logprobs is not supported with disaggregated serving",
            param="prompt_logprobs",
        )  # fmt: skip
    if endpoint == "completions" and body.get("echo") and body.get("logprobs") is not None:
        raise BadRequest(
            400, "echo with logprobs (prompt logprobs) is not supported with disaggregated "
            "serving", param="echo",
        )  # fmt: skip
    max_tokens = _optional_positive_int(body, "max_tokens")
    prompt_text: str | None
    prompt_count: int | None = None
    if endpoint == "chat":
        max_tokens = _optional_positive_int(body, "max_completion_tokens") or max_tokens
        prompt_text, message_count = _messages(body)
        batch = None
    else:
        prompt_text, prompt_count, batch = _prompt(body)
        message_count = 0
    if batch is not None and stream:
        raise BadRequest(
            400, "batched prompts are served only without stream (each prompt is its own PD "
            "request); send one prompt per streamed request", param="prompt",
        )  # fmt: skip
    if n * len(batch or (None,)) > MAX_CHOICES:
        raise BadRequest(
            400, f"at most {MAX_CHOICES} choices (prompts times n) per request", param="n"
        )
    return ClientRequest(
        endpoint=endpoint,
        body=strip_client_kv_params(body),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        max_tokens=max_tokens,
        prompt_text=prompt_text,
        prompt_token_count=prompt_count,
        message_count=message_count,
        model=model,
        n=n,
        batch=batch,
    )


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """`/v1/embeddings`: passed to an embed engine as the client sent it."""

    raw: bytes
    model: str


def parse_embeddings(raw: bytes, default_model: str) -> EmbeddingsRequest:
    """What the router needs to know before it passes an embeddings request on: a JSON
    object, its model, and an input (OpenAI's `input`, or vLLM's chat-style `messages`). The
    engine judges the rest and its 4xx is the client's."""
    body, model = _object_with_model(raw, default_model)
    if "input" not in body and "messages" not in body:
        raise BadRequest(400, "'input' is required", param="input")
    inputs = body.get("input")
    if "input" in body and not _embeddable(inputs):
        raise BadRequest(
            400,
            "'input' must be a string, a list of strings, a list of token ids, or a list of "
            "lists of token ids, and not empty",
            param="input",
        )
    return EmbeddingsRequest(raw, model)


def _embeddable(inputs: Any) -> bool:
    if isinstance(inputs, str):
        return True
    if not isinstance(inputs, list) or not inputs:
        return False
    return (
        all(isinstance(i, str) for i in inputs)
        or all(_is_int(t) for t in inputs)
        or all(isinstance(i, list) and i and all(_is_int(t) for t in i) for i in inputs)
    )
