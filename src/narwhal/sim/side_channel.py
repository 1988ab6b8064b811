"""The KV side channel: a decode engine reads a prefill engine's blocks over TCP.

The stand-in for NIXL's transfer: one connection per handoff, a one-line JSON request
`{"engine_id", "request_id", "block_ids"}` and a one-line JSON answer, either
`{"ok": true, "blocks": [[token ids], ...]}` or `{"ok": false, "error": "..."}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from narwhal.sim.handoff import RemoteHandoff
from narwhal.sim.kv import Block
from narwhal.sim.kv_store import KvLoadError, KvStore

_LINE_LIMIT = 64 * 1024 * 1024
_REQUEST_READ_TIMEOUT_S = 10.0
_MAX_TOKEN_ID = 1 << 32


class SideChannelServer:
    """Serves this engine's stored handoffs; a read frees them."""

    def __init__(self, store: KvStore, engine_id: str, on_served: Callable[[int], None]) -> None:
        self._store = store
        self._engine_id = engine_id
        self._on_served = on_served
        self._server: asyncio.Server | None = None

    async def start(self, host: str) -> int:
        """Listen on an ephemeral port of `host`; returns the port."""
        self._server = await asyncio.start_server(self._serve, host, 0, limit=_LINE_LIMIT)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_READ_TIMEOUT_S):
                line = await reader.readline()
            answer = self._answer(line)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):  # ValueError: line too long
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            engine_id, request_id = req["engine_id"], req["request_id"]
            block_ids = req["block_ids"]
        except (ValueError, TypeError, KeyError):
            block_ids = None
        if not isinstance(block_ids, list):
            return {"ok": False, "error": "malformed side-channel request"}
        if engine_id != self._engine_id:
            return {"ok": False, "error": f"engine id {engine_id!r} is not {self._engine_id!r}"}
        try:
            blocks = self._store.take(str(request_id), block_ids)
        except KvLoadError as exc:
            return {"ok": False, "error": str(exc)}
        self._on_served(len(blocks))
        return {"ok": True, "blocks": blocks}


async def fetch_blocks(handoff: RemoteHandoff, timeout_s: float) -> tuple[Block, ...]:
    """Read a handoff from a prefill engine's side channel; raises KvLoadError on any failure."""
    host, port = handoff.host, handoff.port
    request = {
        "engine_id": handoff.engine_id,
        "request_id": handoff.request_id,
        "block_ids": list(handoff.block_ids),
    }
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, limit=_LINE_LIMIT)
            try:
                writer.write(json.dumps(request).encode() + b"\n")
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.close()
    except TimeoutError as exc:
        raise KvLoadError(f"side channel {host}:{port} timed out") from exc
    except (OSError, ValueError) as exc:
        raise KvLoadError(f"side channel {host}:{port} unreachable: {exc}") from exc
    return _parse_answer(line)


def _parse_answer(line: bytes) -> tuple[Block, ...]:
    try:
        answer = json.loads(line)
    except ValueError as exc:
        raise KvLoadError("side channel sent a malformed answer") from exc
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        error = answer.get("error") if isinstance(answer, dict) else None
        raise KvLoadError(str(error or "side channel refused the read"))
    blocks = answer.get("blocks")
    if not isinstance(blocks, list) or not all(_is_block(b) for b in blocks):
        raise KvLoadError("side channel sent malformed blocks")
    return tuple(tuple(b) for b in blocks)


def _is_block(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _MAX_TOKEN_ID for t in value
    )
