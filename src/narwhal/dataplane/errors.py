"""OpenAI-shaped error responses, for bodies and for SSE streams."""

from __future__ import annotations

import orjson

from narwhal.dataplane.exchange import Answer


def error_body(message: str, type_: str, code: int | str | None, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def error_answer(
    status: int,
    message: str,
    type_: str,
    outcome: str,
    *,
    param: str | None = None,
    retry_after_s: int | None = None,
    code: str | None = None,
) -> Answer:
    """`openai_error` as the data plane's `Answer`, counted under `outcome`; the body's
    `code` is `code`, else the status."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    body = error_body(message, type_, code or status, param)
    return Answer(status, body, "application/json", outcome, headers)


def sse_error_event(message: str, type_: str, code: int) -> bytes:
    """The event that ends a client's stream after a failure (no `[DONE]` follows)."""
    return b"data: " + error_body(message, type_, code) + b"\n\n"
