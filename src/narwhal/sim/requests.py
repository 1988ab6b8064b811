"""Completion and tokenize request bodies, validated the way vLLM's OpenAI server takes them.

Unknown fields are accepted and ignored (vLLM logs and ignores them); what the sim acts on is
typed here. Sampling knobs (`temperature`, `seed`, ...) are accepted and have no effect.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from narwhal.sim.tokens import WORDS, Tokenizer


class RequestError(Exception):
    """A request the engine answers with an error status (OpenAI error shape)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


DEFAULT_MAX_TOKENS = 16  # vLLM's default for completions; the sim uses it for chat too
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Generation(_Body):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    n: int = 1
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM: the prompt's and each chunk's token ids
    cache_salt: str | None = None  # vLLM: keys the prompt's first KV block, so no other shares it

    @property
    def token_limit(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else self.stop


class CompletionBody(_Generation):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]

    def prompt_ids(self, tokenizer: Tokenizer = WORDS) -> list[int]:
        p = self.prompt
        if isinstance(p, str):
            return tokenizer.encode(p)
        if len(p) == 1 and isinstance(p[0], str | list):
            return tokenizer.encode(p[0]) if isinstance(p[0], str) else list(p[0])
        if all(isinstance(t, int) for t in p):
            return [t for t in p if isinstance(t, int)]
        raise RequestError(400, "batched prompts are not supported by narwhal-sim", "prompt")


class ChatBody(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    # vLLM: the last (assistant) message is the start of the answer, to be continued.
    continue_final_message: bool = False

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def prompt_ids(self, tokenizer: Tokenizer = WORDS) -> list[int]:
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                400, "continue_final_message and add_generation_prompt are exclusive"
            )
        messages = [m.model_dump() for m in self.messages]
        return tokenizer.encode_chat(messages, self.add_generation_prompt)


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    def prompt_ids(self, tokenizer: Tokenizer = WORDS) -> list[int]:
        if self.messages is not None:
            messages = [m.model_dump() for m in self.messages]
            return tokenizer.encode_chat(messages, self.add_generation_prompt)
        if self.prompt is not None:
            return tokenizer.encode(self.prompt)
        raise RequestError(400, "either 'prompt' or 'messages' is required", "prompt")


B = TypeVar("B", bound=_Body)


def parse(cls: type[B], body: Any) -> B:
    """Validate a decoded JSON body; a validation problem is a 400 naming the field."""
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise RequestError(400, f"{where}: {err['msg']}" if where else err["msg"], where) from exc
