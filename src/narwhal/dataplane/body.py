"""A client request's whole body, bounded by `serving.max_body_bytes` (DESIGN §12)."""

from __future__ import annotations

from narwhal.dataplane.exchange import Exchange
from narwhal.dataplane.requests import BadRequest


async def read_body(exchange: Exchange, limit: int) -> bytes:
    """The whole body, which may arrive in many chunks; a 413 past `limit` bytes, declared or
    sent."""
    length = exchange.content_length
    if length is not None and length > limit:
        raise BadRequest(413, f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while chunk := await exchange.read_some():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
