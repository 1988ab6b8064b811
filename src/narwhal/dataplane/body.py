"""A client request's whole body, bounded by `serving.max_body_bytes` (DESIGN §12)."""

from __future__ import annotations

from narwhal.dataplane.exchange import Answer, Exchange
from narwhal.dataplane.outcomes import bad_request
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


async def size_before_key(exchange: Exchange, limit: int, refusal: Answer) -> Answer:
    """`refusal` (a missing or wrong key), or the 413 of a body too large: DESIGN §12 checks
    the size before the key, on every route. A declared size was checked with the head; a
    chunked body, which declares none, is read first (up to `limit`, then dropped)."""
    if exchange.content_length is not None or exchange.header("transfer-encoding") is None:
        return refusal
    try:
        await read_body(exchange, limit)
    except BadRequest as exc:
        return bad_request(exc)
    return refusal
