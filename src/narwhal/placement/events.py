"""vLLM's KV-event batches, decoded into frozen values; garbage becomes a `DecodeError` value.

vLLM's publisher (`--kv-events-config`) sends msgpack `EventBatch {ts, events,
data_parallel_rank}` whose events are `BlockStored`, `BlockRemoved` and `AllBlocksCleared`,
tagged by class name. Releases differ: every struct as an array (the tag first), the batch as an
array with map events (the tag under "type"), or all maps; fields were added over time at the
end, so every field after the first few has a default. A decoder tries the layout that worked
last first, so a stream costs one decode per batch. Block hashes are ints or bytes, depending on
the engine's hash algorithm. An event of a kind this module does not know is skipped and
counted, not fatal to its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

EngineHash = int | bytes
"""An engine's own block hash: only meaningful to that engine (its seed, its hash algorithm)."""

MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, frozen=True, tag="BlockStored"):
    """Full blocks an engine cached, chained on `parent_block_hash` (None: the prompt's start)."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True, tag="BlockRemoved"):
    """Blocks an engine evicted from `medium` (None: the GPU)."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag="AllBlocksCleared"):
    """The engine's prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    skipped_events: int = 0
    """Events of a kind this version does not know (a newer vLLM), left out of `events`."""


@dataclass(frozen=True, slots=True)
class DecodeError:
    """A payload that is not an event batch in either encoding."""

    reason: str


# The array encoding: the same fields in the same order, as subclasses so that callers only
# ever see the three public types.
class _ArrayBlockStored(BlockStored, frozen=True, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(BlockRemoved, frozen=True, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(
    AllBlocksCleared, frozen=True, array_like=True, tag="AllBlocksCleared"
):
    pass


class _MapBatch(msgspec.Struct, frozen=True):
    ts: float
    events: tuple[BlockStored | BlockRemoved | AllBlocksCleared, ...]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, frozen=True, array_like=True):
    ts: float
    events: tuple[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared, ...]
    data_parallel_rank: int | None = None


class _MixedBatch(msgspec.Struct, frozen=True, array_like=True):
    ts: float
    events: tuple[BlockStored | BlockRemoved | AllBlocksCleared, ...]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct, frozen=True):
    ts: float
    events: tuple[msgspec.Raw, ...]
    data_parallel_rank: int | None = None


class _RawArrayBatch(msgspec.Struct, frozen=True, array_like=True):
    ts: float
    events: tuple[msgspec.Raw, ...]
    data_parallel_rank: int | None = None


_BatchDecoder = (
    msgspec.msgpack.Decoder[_MapBatch]
    | msgspec.msgpack.Decoder[_ArrayBatch]
    | msgspec.msgpack.Decoder[_MixedBatch]
)


class BatchDecoder:
    """Decodes payloads; one per subscriber (msgspec decoders are reusable, not shared state)."""

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(_MapBatch)
        self._arrays: list[_BatchDecoder] = [
            msgspec.msgpack.Decoder(_ArrayBatch),
            msgspec.msgpack.Decoder(_MixedBatch),
        ]
        self._raw_map = msgspec.msgpack.Decoder(_RawMapBatch)
        self._raw_array = msgspec.msgpack.Decoder(_RawArrayBatch)
        self._map_event = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
        self._array_event = msgspec.msgpack.Decoder(
            _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared
        )
        self._any: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> EventBatch | DecodeError:
        """The batch in `payload`, or why it is not one. Never raises."""
        if not payload:
            return DecodeError("empty payload")
        first = payload[0]
        is_map = 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)
        is_array = 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)
        if not (is_map or is_array):
            return DecodeError(f"not a msgpack map or array (first byte 0x{first:02x})")
        decoders: list[_BatchDecoder] = [self._map] if is_map else self._arrays
        for position, decoder in enumerate(decoders):
            try:
                batch = decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if position:  # the other array layout: try it first from now on
                decoders.insert(0, decoders.pop(position))
            return EventBatch(batch.ts, batch.events, batch.data_parallel_rank)
        # Maybe an event of a kind we do not know, or layouts mixed within the batch.
        return self._tolerant(payload, is_map)

    def _tolerant(self, payload: bytes, is_map: bool) -> EventBatch | DecodeError:
        try:
            raw = (self._raw_map if is_map else self._raw_array).decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return DecodeError(f"not an event batch: {exc}")
        events: list[Event] = []
        skipped = 0
        for item in raw.events:
            head = bytes(memoryview(item)[:1])
            event_is_map = bool(head) and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))
            event_decoder = self._map_event if event_is_map else self._array_event
            try:
                events.append(event_decoder.decode(item))
            except msgspec.ValidationError as exc:
                tag = self._tag(item, event_is_map)
                if isinstance(tag, str) and tag not in _KNOWN_TAGS:
                    skipped += 1
                    continue
                return DecodeError(f"malformed event: {exc}")
            except msgspec.DecodeError as exc:
                return DecodeError(f"malformed event: {exc}")
        return EventBatch(raw.ts, tuple(events), raw.data_parallel_rank, skipped)

    def _tag(self, item: msgspec.Raw, is_map: bool) -> object:
        """The event's tag (its kind), or None when it has none."""
        try:
            value = self._any.decode(item)
        except msgspec.DecodeError:
            return None
        if is_map and isinstance(value, dict):
            return value.get("type")
        if not is_map and isinstance(value, list) and value:
            return value[0]
        return None


_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
