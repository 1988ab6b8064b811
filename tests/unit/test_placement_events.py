"""Decoding vLLM's event batches in every encoding its releases used; garbage is a value."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.placement.events import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
)
from narwhal.sim import kv_events as sim

STORED = sim.BlockStored(
    block_hashes=(b"\x01" * 32, b"\x02" * 32),
    parent_block_hash=None,
    token_ids=tuple(range(32)),
    block_size=16,
    lora_name="sql",
    extra_keys=(("sql", "salt"), ("sql",)),
)
REMOVED = sim.BlockRemoved(block_hashes=(b"\x01" * 32,), medium="CPU")


def _fields(event: object) -> dict[str, object]:
    return {f: getattr(event, f) for f in event.__struct_fields__}  # type: ignore[attr-defined]


@pytest.mark.parametrize("encoding", list(sim.EventEncoding))
@pytest.mark.parametrize("hash_format", list(sim.BlockHashFormat))
def test_every_encoding_the_simulator_speaks(
    encoding: sim.EventEncoding, hash_format: sim.BlockHashFormat
) -> None:
    payload = sim.encode_batch(
        12.5,
        [STORED, REMOVED, sim.AllBlocksCleared()],
        encoding=encoding,
        hash_format=hash_format,
        data_parallel_rank=1,
    )
    batch = BatchDecoder().decode(payload)
    assert isinstance(batch, EventBatch), batch
    assert batch.ts == 12.5 and batch.data_parallel_rank == 1 and batch.skipped_events == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    expected_hash = sim.external_hash(b"\x01" * 32, hash_format)
    assert stored.block_hashes[0] == expected_hash
    assert stored.token_ids == tuple(range(32)) and stored.block_size == 16
    assert stored.lora_name == "sql" and stored.parent_block_hash is None
    assert stored.extra_keys == (("sql", "salt"), ("sql",))
    assert removed.block_hashes == (expected_hash,) and removed.medium == "CPU"


def test_one_decoder_follows_a_stream_that_changes_layout() -> None:
    decoder = BatchDecoder()
    for encoding in [*sim.EventEncoding, *reversed(sim.EventEncoding)]:
        batch = decoder.decode(sim.encode_batch(1.0, [REMOVED], encoding=encoding))
        assert isinstance(batch, EventBatch) and len(batch.events) == 1


def test_the_newest_map_layout_with_fields_this_version_does_not_know() -> None:
    payload = msgspec.msgpack.encode(
        {
            "ts": 3.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [7],
                    "parent_block_hash": 6,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": None, "group_idx": 1},
            ],
        }
    )
    batch = BatchDecoder().decode(payload)
    assert isinstance(batch, EventBatch) and batch.data_parallel_rank is None
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == 6
    assert stored.group_idx == 0 and isinstance(removed, BlockRemoved) and removed.group_idx == 1


def test_the_oldest_array_layout_without_medium_or_rank() -> None:
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [1, 2], None, [9] * 4, 2, None]]])
    batch = BatchDecoder().decode(payload)
    assert isinstance(batch, EventBatch)
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert _fields(stored)["medium"] is None and stored.block_hashes == (1, 2)


@pytest.mark.parametrize("as_map", [True, False])
def test_an_unknown_event_kind_is_skipped_not_fatal(as_map: bool) -> None:
    if as_map:
        events: list[object] = [
            {"type": "BlocksPinned", "count": 3},
            {"type": "AllBlocksCleared"},
        ]
        payload = msgspec.msgpack.encode({"ts": 1.0, "events": events})
    else:
        payload = msgspec.msgpack.encode([1.0, [["BlocksPinned", 3], ["AllBlocksCleared"]], 0])
    batch = BatchDecoder().decode(payload)
    assert isinstance(batch, EventBatch)
    assert batch.skipped_events == 1 and isinstance(batch.events[0], AllBlocksCleared)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        msgspec.msgpack.encode(42),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode({"ts": "yesterday", "events": []}),
        msgspec.msgpack.encode([1.0, [["BlockStored", "no", None, [1], 1, None]]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved"]]]),
        msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockRemoved"}]}),
        msgspec.msgpack.encode([1.0, [7]]),
        msgspec.msgpack.encode([1.0, [{"no": "tag"}]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 1]]])[:-2],
    ],
)
def test_garbage_is_a_decode_error_value(payload: bytes) -> None:
    assert isinstance(BatchDecoder().decode(payload), DecodeError)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_no_bytes_make_the_decoder_raise(payload: bytes) -> None:
    assert isinstance(BatchDecoder().decode(payload), EventBatch | DecodeError)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text()
        | st.binary(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=12,
    )
)
def test_no_msgpack_value_makes_the_decoder_raise(value: object) -> None:
    payload = msgspec.msgpack.encode(value)
    assert isinstance(BatchDecoder().decode(payload), EventBatch | DecodeError)
