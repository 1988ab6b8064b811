"""The sim's `/v1/embeddings` (an engine started with `--role embed`, as vLLM serves a pooling
model): a deterministic unit vector per input, so a test can tell inputs (and engines' answers)
apart and check the router passed them in order.

Inputs are OpenAI's: a string, a list of strings, a list of token ids, or a list of lists of
token ids. `encoding_format` `base64` gives the vector as little-endian float32 bytes, as
vLLM and OpenAI do (the official client asks for it by default).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any, Literal

from pydantic import Field

from narwhal.sim.requests import RequestError, TokenId, _Body
from narwhal.sim.tokens import tokenize

DIMENSIONS = 16


class EmbeddingsBody(_Body):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=4 * DIMENSIONS)

    def token_lists(self) -> list[list[int]]:
        """One token-id list per input, in order."""
        inputs = self.input
        if isinstance(inputs, str):
            return [tokenize(inputs)]
        if not inputs:
            raise RequestError(400, "input must not be empty", "input")
        if all(isinstance(i, int) for i in inputs):
            return [[int(t) for t in inputs]]  # type: ignore[arg-type]
        return [tokenize(i) if isinstance(i, str) else list(i) for i in inputs]  # type: ignore[arg-type]


def vector(tokens: list[int], dimensions: int) -> list[float]:
    """A unit vector that depends only on the tokens (the same input, the same vector)."""
    seed = hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).digest()
    raw: list[float] = []
    block = seed
    while len(raw) < dimensions:
        block = hashlib.sha256(block).digest()
        raw.extend((b - 127.5) / 127.5 for b in block)
    raw = raw[:dimensions]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def encoded(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


def answer(body: EmbeddingsBody, model: str, request_id: str, created: int) -> dict[str, Any]:
    tokens = body.token_lists()
    dimensions = body.dimensions or DIMENSIONS
    data = [
        {"index": i, "object": "embedding",
         "embedding": encoded(vector(t, dimensions), body.encoding_format)}
        for i, t in enumerate(tokens)
    ]  # fmt: skip
    prompt_tokens = sum(len(t) for t in tokens)
    return {
        "id": f"embd-{request_id}",
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
