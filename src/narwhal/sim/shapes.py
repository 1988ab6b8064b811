"""vLLM's OpenAI response shapes: completion and chat objects, SSE chunks, errors.

Streaming avoids per-token JSON encoding: each request builds its chunk template once (by
encoding a chunk with a marker for the text and splitting there) and each token is
`prefix + pre-encoded word + suffix`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from narwhal.sim.generation import JSON_FIRST, JSON_NEXT, Generated, text_of

DONE = b"data: [DONE]\n\n"
MALFORMED_EVENT = b'data: {"choices": [{"index": 0, "text": \n\n'
# How vLLM reports an error during generation: this event, then `data: [DONE]`.
ERROR_EVENT = (
    b'data: {"error": {"object": "error", "message": "narwhal-sim: injected error_event", '
    b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
)
_MARKER = "@@narwhal-sim-text@@"
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error object: `code` is the HTTP status, `type` names the error class."""
    try:
        phrase = HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:
        phrase = "Unknown"
    err_type = _ERROR_TYPES.get(status, phrase + "Error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every object of one response repeats."""

    chat: bool
    id: str
    created: int
    model: str

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def response_body(
    env: Envelope, gen: Generated, usage_: dict[str, Any], extra: dict[str, Any]
) -> dict[str, Any]:
    """The non-streaming answer; `extra` holds top-level fields (`kv_transfer_params`)."""
    text = text_of(gen.indices)
    choice: dict[str, Any] = {"index": 0}
    if env.chat:
        choice["message"] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": None,
            "tool_calls": [],
        }
    else:
        choice["text"] = text
    choice |= {"logprobs": None, "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason}
    head = env.head("chat.completion" if env.chat else "text_completion")
    return head | {"choices": [choice], "usage": usage_, "prompt_logprobs": None} | extra


class ChunkTemplate:
    """The SSE events of one streamed response."""

    def __init__(self, env: Envelope) -> None:
        self._env = env
        self._object = "chat.completion.chunk" if env.chat else "text_completion"
        encoded = self._event(_MARKER, None, None).split(dumps(_MARKER))
        self._prefix, self._suffix = encoded

    def _chunk(self, text: str, finish: str | None, stop: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self._env.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": finish, "stop_reason": stop}
        return self._env.head(self._object) | {"choices": [choice]}

    def _event(self, text: str, finish: str | None, stop: str | None) -> bytes:
        return b"data: " + dumps(self._chunk(text, finish, stop)) + b"\n\n"

    def role(self) -> bytes:
        """Chat's first event: the assistant role with empty content."""
        chunk = self._chunk("", None, None)
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return b"data: " + dumps(chunk) + b"\n\n"

    def token(self, index: int, position: int) -> bytes:
        word = JSON_FIRST[index] if position == 0 else JSON_NEXT[index]
        return self._prefix + word + self._suffix

    def final(self, text: str, finish: str, stop: str | None) -> bytes:
        """The last content event: it carries the finish reason."""
        return self._event(text, finish, stop)

    def usage(self, usage_: dict[str, Any]) -> bytes:
        chunk = self._env.head(self._object) | {"choices": [], "usage": usage_}
        return b"data: " + dumps(chunk) + b"\n\n"
