"""Narwhal's block keys: a chained 64-bit hash over a prompt's token ids, one key per full block.

The key of block i depends on its tokens, its extra keys and the key of block i-1; the first
block's predecessor is a root derived from the LoRA name. So two prompts share key i exactly when
they share the first i+1 blocks (up to 64-bit collisions), and a key stands for a whole prefix.
Keys are computed the same way from a request (`prompt_keys`) and from an engine's
`BlockStored` event (`chain_keys`, starting from the parent block's key), never from the engine's
own hash values (those depend on the engine's seed and hash algorithm).

Hash: xxh3_64 seeded with the previous key, over the block's token ids as little-endian uint32.
Deterministic across processes and hosts (unlike `hash()`), and the cheapest well-kept choice
measured (bench/placement_bench.py, one loaded core): a 4096-token prompt in blocks of 16 costs
about 90-130 us with xxh3_64 against 590-650 us with a keyed blake2b(digest_size=8); most of
the xxh3 cost is the Python loop per block. Placement quality is all a collision could cost.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

BlockKey = int
"""A block key: an unsigned 64-bit integer."""

_ROOT_SEED = 0x6E61_7277_6861_6C00  # "narwhal\0": the root of prompts without a LoRA adapter
_encode_extra = msgspec.msgpack.Encoder().encode
_hash = xxhash.xxh3_64_intdigest


class InvalidTokens(ValueError):
    """Token ids that are not unsigned 32-bit integers, or a block size below 1."""


def root_key(lora_name: str | None) -> BlockKey:
    """The predecessor of a prompt's first block: prompts under two adapters share no key."""
    if lora_name is None:
        return _ROOT_SEED
    return _hash(lora_name.encode("utf-8"), _ROOT_SEED)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        tokens = array.array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidTokens(f"token ids must be integers in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens.tobytes()


def chain_keys(
    parent: BlockKey,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids`, the first chained on `parent`.

    `extra_keys[i]`, when given and not empty, enters block i's key (a cache salt, multimodal
    identifiers); a trailing partial block gets no key.
    """
    if block_size < 1:
        raise InvalidTokens(f"block size must be at least 1, got {block_size}")
    data = _token_bytes(token_ids)
    step = block_size * 4
    end = (len(token_ids) // block_size) * step
    keys: list[BlockKey] = []
    append = keys.append
    key = parent
    if not extra_keys:
        for off in range(0, end, step):
            key = _hash(data[off : off + step], key)
            append(key)
        return keys
    for index, off in enumerate(range(0, end, step)):
        block = data[off : off + step]
        extra = extra_keys[index] if index < len(extra_keys) else None
        if extra:
            block += _encode_extra(extra)
        key = _hash(block, key)
        append(key)
    return keys


def prompt_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[BlockKey]:
    """A request's block keys: what an engine that cached this prompt's full blocks would hold.

    The cache salt enters the first block only (it separates tenants; every later key inherits it
    through the chain), as it does in vLLM.
    """
    extra = None if cache_salt is None else [(cache_salt,)]
    return chain_keys(root_key(lora_name), token_ids, block_size, extra)
