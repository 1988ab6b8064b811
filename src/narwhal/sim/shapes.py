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

from narwhal.sim.generation import JSON_WORD, VOCAB_IDS, Generated, text_of, token_text

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
    """What every object of one response repeats; `prompt_ids` when the request asked for
    token ids (`return_token_ids`), which vLLM then adds to the answer."""

    chat: bool
    id: str
    created: int
    model: str
    prompt_ids: tuple[int, ...] | None = None

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
    if env.prompt_ids is not None:
        # vLLM: completions give both per choice; chat gives the prompt's at the top level.
        choice["token_ids"] = list(gen.token_ids)
        where = head if env.chat else choice
        where["prompt_token_ids"] = list(env.prompt_ids)
    return head | {"choices": [choice], "usage": usage_, "prompt_logprobs": None} | extra


class ChunkTemplate:
    """The SSE events of one streamed response.

    With token ids asked for (vLLM's `return_token_ids`), every content event carries its
    `token_ids`, and the first event the prompt's: per choice for completions (the first
    token's event), at the top level for chat (the role event)."""

    def __init__(self, env: Envelope) -> None:
        self._env = env
        self._object = "chat.completion.chunk" if env.chat else "text_completion"
        self._ids = env.prompt_ids is not None
        self._prompt_pending = self._ids and not env.chat
        encoded = self._event(_MARKER, None, None).split(dumps(_MARKER))
        self._prefix, self._suffix = encoded

    def _chunk(
        self, text: str, finish: str | None, stop: str | None, ids: list[int] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self._env.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": finish, "stop_reason": stop}
        if ids is not None:
            if self._prompt_pending:
                self._prompt_pending = False
                choice["prompt_token_ids"] = list(self._env.prompt_ids or ())
            choice["token_ids"] = ids
        return self._env.head(self._object) | {"choices": [choice]}

    def _event(
        self, text: str, finish: str | None, stop: str | None, ids: list[int] | None = None
    ) -> bytes:
        return b"data: " + dumps(self._chunk(text, finish, stop, ids)) + b"\n\n"

    def role(self) -> bytes:
        """Chat's first event: the assistant role with empty content."""
        chunk = self._chunk("", None, None)
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        if self._ids:
            chunk["prompt_token_ids"] = list(self._env.prompt_ids or ())
            chunk["choices"][0]["token_ids"] = []
        return b"data: " + dumps(chunk) + b"\n\n"

    def token(self, index: int) -> bytes:
        if self._ids:
            return self._event(token_text(index), None, None, [VOCAB_IDS[index]])
        return self._prefix + JSON_WORD[index] + self._suffix

    def final(self, index: int | None, finish: str, stop: str | None) -> bytes:
        """The last content event: it carries the finish reason, and the last token if any."""
        if index is None:
            return self._event("", finish, stop, [] if self._ids else None)
        ids = [VOCAB_IDS[index]] if self._ids else None
        return self._event(token_text(index), finish, stop, ids)

    def usage(self, usage_: dict[str, Any]) -> bytes:
        chunk = self._env.head(self._object) | {"choices": [], "usage": usage_}
        return b"data: " + dumps(chunk) + b"\n\n"
