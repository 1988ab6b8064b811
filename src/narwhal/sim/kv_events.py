"""vLLM's KV-cache events and their msgpack wire encodings (what `--kv-events-config` publishes).

A batch is `EventBatch {ts, events, data_parallel_rank}`; an event is `BlockStored`,
`BlockRemoved` or `AllBlocksCleared`, tagged with its class name. vLLM's releases encode them
three ways, all of which a subscriber may meet:

- `array`: the batch and the events as positional arrays, an event's tag first
  (`["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]`);
- `mixed`: the batch as an array, each event as a map with its tag under `"type"`;
- `map`: the batch as a map too (`{"ts", "events", "data_parallel_rank"}`).

Fields left at their default (`extra_keys` None) are omitted, as msgspec's `omit_defaults` does.
Block hashes go out as 64-bit unsigned ints (vLLM's default) or as the raw digest bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"


class EventEncoding(StrEnum):
    ARRAY = "array"
    MIXED = "mixed"
    MAP = "map"


class BlockHashFormat(StrEnum):
    INT = "int"  # the digest's last 8 bytes, big-endian (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    BYTES = "bytes"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that entered the cache, in prompt order; `parent` precedes the first."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    # One entry per block: what besides the tokens went into its hash (LoRA name, cache salt).
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def external_hash(digest: bytes, fmt: BlockHashFormat) -> int | bytes:
    if fmt is BlockHashFormat.BYTES:
        return digest
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def _fields(event: KvEvent, fmt: BlockHashFormat) -> list[tuple[str, Any]]:
    """The event's wire fields in declaration order, trailing defaults omitted."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        fields: list[tuple[str, Any]] = [
            ("block_hashes", [external_hash(h, fmt) for h in event.block_hashes]),
            ("parent_block_hash", None if parent is None else external_hash(parent, fmt)),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", event.lora_id),
            ("medium", event.medium),
            ("lora_name", event.lora_name),
        ]
        if event.extra_keys is not None:
            keys = [None if k is None else list(k) for k in event.extra_keys]
            fields.append(("extra_keys", keys))
        return fields
    if isinstance(event, BlockRemoved):
        hashes = [external_hash(h, fmt) for h in event.block_hashes]
        return [("block_hashes", hashes), ("medium", event.medium)]
    return []


def _event(event: KvEvent, encoding: EventEncoding, fmt: BlockHashFormat) -> Any:
    tag = type(event).__name__
    fields = _fields(event, fmt)
    if encoding is EventEncoding.ARRAY:
        return [tag, *(value for _, value in fields)]
    return {"type": tag, **dict(fields)}


def encode_batch(
    ts: float,
    events: Sequence[KvEvent],
    *,
    encoding: EventEncoding,
    hash_format: BlockHashFormat = BlockHashFormat.INT,
    data_parallel_rank: int = 0,
) -> bytes:
    """One `EventBatch` as msgpack bytes, the payload of a published message."""
    wire = [_event(e, encoding, hash_format) for e in events]
    if encoding is EventEncoding.MAP:
        batch: Any = {"ts": ts, "events": wire, "data_parallel_rank": data_parallel_rank}
    else:
        batch = [ts, wire, data_parallel_rank]
    return msgspec.msgpack.encode(batch)
