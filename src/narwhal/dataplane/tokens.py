"""Prompt-length checks without a third round trip on every request.

A prompt whose UTF-8 size (an upper bound on its token count for byte-level tokenizers),
plus a template margin and `max_tokens`, fits the model needs no counting. Only prompts
near the limit are counted with the engine's `POST /tokenize`, and counts are cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from narwhal.dataplane.requests import BadRequest, ClientRequest

TEMPLATE_MARGIN_TOKENS = 16
PER_MESSAGE_MARGIN_TOKENS = 8


class Verdict(StrEnum):
    EXACT = "exact"  # the client sent token ids
    FITS_BY_BOUND = "fits_by_bound"
    CACHED = "cached"
    COUNTED = "counted"
    UNKNOWN_LIMIT = "unknown_limit"
    COUNT_FAILED = "count_failed"


@dataclass(frozen=True, slots=True)
class TokenCheck:
    verdict: Verdict
    prompt_tokens: int | None


Counter = Callable[[ClientRequest], Awaitable[int | None]]


class TokenBudget:
    def __init__(self, cache_size: int) -> None:
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._size = cache_size

    def _key(self, req: ClientRequest) -> bytes:
        assert req.prompt_text is not None
        return hashlib.blake2b(
            f"{req.endpoint}\0{req.message_count}\0{req.prompt_text}".encode(), digest_size=16
        ).digest()

    async def check(
        self, req: ClientRequest, max_model_len: int | None, count: Counter
    ) -> TokenCheck:
        """Raise BadRequest(400) when the prompt cannot fit the model."""
        if max_model_len is None:
            return TokenCheck(Verdict.UNKNOWN_LIMIT, None)
        # Every leg generates at least one token (the prefill asks for exactly one).
        wanted = req.max_tokens or 1
        if req.prompt_token_count is not None:
            self._enforce(req.prompt_token_count, wanted, max_model_len, req)
            return TokenCheck(Verdict.EXACT, req.prompt_token_count)
        assert req.prompt_text is not None
        bound = (
            len(req.prompt_text.encode())
            + TEMPLATE_MARGIN_TOKENS
            + PER_MESSAGE_MARGIN_TOKENS * req.message_count
        )
        if bound + wanted <= max_model_len:
            return TokenCheck(Verdict.FITS_BY_BOUND, None)
        key = self._key(req)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self._enforce(cached, wanted, max_model_len, req)
            return TokenCheck(Verdict.CACHED, cached)
        counted = await count(req)
        if counted is None:
            return TokenCheck(Verdict.COUNT_FAILED, None)
        if self._size:
            self._cache[key] = counted
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        self._enforce(counted, wanted, max_model_len, req)
        return TokenCheck(Verdict.COUNTED, counted)

    @staticmethod
    def _enforce(prompt_tokens: int, wanted: int, max_model_len: int, req: ClientRequest) -> None:
        if prompt_tokens + wanted > max_model_len:
            raise BadRequest(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_tokens + wanted} tokens ({prompt_tokens} in the messages, "
                f"{wanted} in the completion). Please reduce the length of the messages or "
                "completion.",
                param="max_tokens" if req.max_tokens is not None else "prompt",
                type_="BadRequestError",
            )
