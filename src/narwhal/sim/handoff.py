"""The NixlConnector `kv_transfer_params` the sim produces (prefill) and consumes (decode)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from narwhal.sim.kv_store import KvLoadError

# What the `handoff_garbage` fault returns: every field present, several of the wrong type.
GARBAGE_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": 0,
    "remote_block_ids": "x",
    "remote_request_id": None,
    "remote_host": ["?"],
    "remote_port": "nope",
    "tp_size": "one",
}


@dataclass(frozen=True, slots=True)
class RemoteHandoff:
    """Where a decode leg reads its KV from."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int


def produced_params(
    engine_id: str, request_id: str, block_ids: list[int], host: str, port: int
) -> dict[str, Any]:
    """A prefill leg's handoff, as vLLM's NixlConnector returns it."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_ids,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_handoff(params: Mapping[str, Any]) -> RemoteHandoff:
    """A decode leg's handoff; raises KvLoadError naming the first unusable field."""
    for name in ("remote_engine_id", "remote_request_id", "remote_host"):
        if not isinstance(params.get(name), str):
            raise KvLoadError(f"malformed kv_transfer_params: {name} is not a string")
    block_ids = params.get("remote_block_ids")
    if not isinstance(block_ids, list) or not all(_is_int(b) for b in block_ids):
        raise KvLoadError("malformed kv_transfer_params: remote_block_ids is not a list of ints")
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise KvLoadError("malformed kv_transfer_params: remote_port is not a port number")
    return RemoteHandoff(
        engine_id=params["remote_engine_id"],
        request_id=params["remote_request_id"],
        block_ids=tuple(block_ids),
        host=params["remote_host"],
        port=port,
    )
