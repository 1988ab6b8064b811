"""One request, traceable end to end (issue 20): its id, the trace context it carries, and
what the access log says about it once it ends.

The id is the client's `X-Request-Id` when it is printable ASCII of at most 128 characters,
else one the router makes. Every response carries it back; each engine attempt gets an id
that contains it and is unique (fresh KV ownership needs a fresh id); the SSE error event and
the request's log lines name it. `traceparent` and `tracestate` go to both legs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

MAX_CLIENT_ID = 128
TRACE_HEADERS = ("traceparent", "tracestate")


def client_request_id(value: str | None) -> str | None:
    """The client's id if it may be echoed (printable ASCII, 1-128 characters), else None."""
    if not value or len(value) > MAX_CLIENT_ID:
        return None
    if not value.isascii() or not value.isprintable():
        return None
    return value


@dataclass(slots=True)
class RequestRecord:
    """Filled as the request runs; `to_json` is its access-log line."""

    request_id: str
    endpoint: str
    # The base of its attempt ids: the id itself when the router made it (unique already),
    # the client's id with a router-made suffix otherwise (a client may reuse its ids).
    attempt_base: str
    trace: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    key: str | None = None  # the client key's label, with authentication on
    status: int = 0
    outcome: str = ""
    prefill: str | None = None
    decode: str | None = None
    attempts: int = 0
    migrations: int = 0
    ttft_s: float | None = None
    duration_s: float = 0.0
    # Where the token counts are: the JSON answer, or a stream's last data event (`usage`
    # with `stream_options.include_usage`); parsed only when the line is written.
    usage_source: bytes | None = None
    span: Any = None  # its OpenTelemetry span, when tracing is on

    def next_attempt_id(self) -> str:
        self.attempts += 1
        return f"{self.attempt_base}-a{self.attempts}"

    def to_json(self) -> dict[str, Any]:
        prompt_tokens, completion_tokens = usage_tokens(self.usage_source)
        return {
            "id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "key": self.key,
            "status": self.status,
            "outcome": self.outcome,
            "prefill": self.prefill,
            "decode": self.decode,
            "attempts": self.attempts,
            "migrations": self.migrations,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "duration_s": round(self.duration_s, 6),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
        }


def usage_tokens(source: bytes | None) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a JSON answer's or an SSE data event's `usage`:
    what the access log writes and what flow control charges the key."""
    if source is None:
        return None, None
    try:
        parsed = orjson.loads(source.removeprefix(b"data: "))
    except orjson.JSONDecodeError:
        return None, None
    found = parsed.get("usage") if isinstance(parsed, dict) else None
    if not isinstance(found, dict):
        return None, None
    prompt, output = found.get("prompt_tokens"), found.get("completion_tokens")
    return (
        prompt if type(prompt) is int else None,
        output if type(output) is int else None,
    )
