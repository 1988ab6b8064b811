"""A prompt's KV cache: blocks of 16 token ids, and the digest that identifies the context.

Block content is derived from the token ids only, so the blocks a decode engine receives carry
exactly the context the prefill engine computed; the digest chains the blocks like vLLM's
prefix-cache block hashes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_SIZE = 16
_ROOT = b"narwhal-sim-kv"

Block = tuple[int, ...]


def blocks_of(token_ids: Sequence[int], size: int = BLOCK_SIZE) -> list[Block]:
    """The KV blocks of a context; the last one may be partial."""
    return [tuple(token_ids[i : i + size]) for i in range(0, len(token_ids), size)]


def digest(token_ids: Sequence[int]) -> bytes:
    """The chained block hash of a context: equal digests mean equal contexts."""
    h = _ROOT
    for i in range(0, len(token_ids), BLOCK_SIZE):
        chunk = array("I", token_ids[i : i + BLOCK_SIZE]).tobytes()
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
    return h


def context_from_blocks(blocks: Sequence[Block], prompt_ids: Sequence[int]) -> list[int]:
    """The context a decode computes from: the loaded KV, then any prompt tokens it lacks.

    The KV wins over the local prompt: a handoff from another prompt gives another context.
    """
    loaded = [t for block in blocks for t in block]
    return loaded + list(prompt_ids[len(loaded) :])
