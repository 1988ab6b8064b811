"""How an attempt can end, and the client's answer for each: the request path's vocabulary.

The legs raise these; the policy (`policy.py`) decides what comes next from them; the answers
here are what a client is told when the policy stops. All pure.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.config import Role
from narwhal.dataplane.errors import error_answer, error_body
from narwhal.dataplane.exchange import Answer
from narwhal.dataplane.requests import BadRequest, ClientRequest
from narwhal.engine.failures import ClientError, EngineFailure, FailureClass
from narwhal.fleet.readiness import starting_reason


class NoCapacity(Exception):
    """No eligible engine of `role`: `starting` when none was ever verified (DESIGN §10)."""

    def __init__(self, role: Role, starting: bool = False) -> None:
        super().__init__(starting_reason(role) if starting else f"no capacity: {role.value}")
        self.role = role


class Saturated(Exception):
    """The chosen engine or the data pool cannot take the request now."""


class ClientGone(Exception):
    """The client disconnected; nothing is recorded against any engine."""


class DeadlineExceeded(Exception):
    """The request's own deadline ran out while the engine was making progress."""


class Moved(Exception):
    """The operator moved the stream off its decode engine (planned maintenance with
    `migrate`) before the stream's first byte: the policy retries it elsewhere, and the engine
    is charged nothing."""


class Interrupted(Exception):
    """A leg failed after the client's stream began, and the stream can be continued
    (`dataplane/migration.py`); the engine has its evidence already."""

    def __init__(self, failure: EngineFailure, cause: str, engine_id: str) -> None:
        super().__init__(cause)
        self.failure = failure
        self.cause = cause
        self.engine_id = engine_id  # the engine the stream left


Settling = ClientError | NoCapacity | DeadlineExceeded
"""An attempt's outcome that ends the request whatever the policy."""


class NotResumed(Exception):
    """A stream preempted for a more urgent request was refused its turn to go on (the
    router stopped admitting while it waited)."""


def reason(exc: Exception) -> str:
    """The label of a retry or a migration step's failure."""
    if isinstance(exc, EngineFailure):
        return exc.failure_class.value
    if isinstance(exc, NoCapacity):
        return "no_capacity"
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, Moved):
        return "maintenance"
    if isinstance(exc, NotResumed):
        return "not_admitted"
    return "saturated"


def cause(failure: EngineFailure) -> str:
    """Why a stream was migrated: `connection_lost`, `stream_idle` (mid-stream silence),
    `error_event` (in band), `invalid_termination` (no `[DONE]`, a malformed event)."""
    cls = failure.failure_class
    if cls is FailureClass.STREAM:
        return "stream_idle" if failure.timed_out else "invalid_termination"
    if cls is FailureClass.INFERENCE_STATUS:
        return "error_event"
    if cls is FailureClass.CONNECTION:
        return "connection_lost"
    return cls.value


def status_for(exc: Exception | None) -> tuple[int, str]:
    if isinstance(exc, DeadlineExceeded):
        return 504, "request deadline exceeded"
    if isinstance(exc, NotResumed):
        return 503, str(exc)
    if isinstance(exc, EngineFailure):
        if exc.failure_class is FailureClass.TIMEOUT or exc.timed_out:
            return 504, f"upstream timeout: {exc.detail}"
        return 502, f"upstream failure ({exc.failure_class.value}): {exc.detail}"
    return 502, "upstream failure"


def settled(exc: Settling) -> Answer:
    """The engine's 4xx, no capacity (503), or the request's own deadline (504)."""
    if isinstance(exc, ClientError):
        return Answer(exc.status, exc.body, exc.content_type or "application/json", "client_error")
    if isinstance(exc, NoCapacity):
        return error_answer(503, str(exc), "service_unavailable", "no_capacity", retry_after_s=1)
    return error_answer(504, "request deadline exceeded", "timeout", "deadline")


def failure_response(exc: Exception | None) -> Answer:
    """The answer once the policy gave up: the last attempt's failure."""
    if isinstance(exc, Moved):  # every attempt was moved off by planned maintenance
        return error_answer(
            503,
            "engines went into planned maintenance during the request",
            "service_unavailable",
            "no_capacity",
            retry_after_s=1,
        )
    if isinstance(exc, Saturated):
        return error_answer(
            503, f"server saturated: {exc}", "service_unavailable", "saturated", retry_after_s=1
        )
    status, message = status_for(exc)
    outcome = "upstream_timeout" if status == 504 else "upstream_error"
    return error_answer(status, message, "upstream_error", outcome)


def bad_request(exc: BadRequest) -> Answer:
    return error_answer(
        exc.status, exc.message, exc.type, "bad_request", param=exc.param, code=exc.code
    )


def client_error_body(engine_body: bytes) -> bytes:
    """An engine's error, in the OpenAI error shape as a 400 (`{"error": {...}}` or vLLM's
    flat `{"object": "error", "message": ...}`; any other body's text as the message)."""
    try:
        parsed = orjson.loads(engine_body)
        inner = parsed.get("error", parsed) if isinstance(parsed, dict) else None
        message = inner.get("message") if isinstance(inner, dict) else None
    except orjson.JSONDecodeError:
        message = None
    if not isinstance(message, str):
        message = engine_body[:1024].decode(errors="replace")
    return error_body(message, "BadRequestError", 400, param="prompt")


def finished_response(req: ClientRequest, parsed: dict[str, Any]) -> Answer:
    """The prefill's one token completed the request: answer it, as a stream if asked."""
    parsed.pop("kv_transfer_params", None)
    if not req.stream:
        return Answer(200, orjson.dumps(parsed), "application/json")
    choice = dict(parsed["choices"][0]) if parsed.get("choices") else {"index": 0}
    chunk: dict[str, Any] = {k: parsed.get(k) for k in ("id", "created", "model")}
    if req.endpoint == "chat":
        message = choice.pop("message", None)
        message = message if isinstance(message, dict) else {}
        chunk["object"] = "chat.completion.chunk"
        choice["delta"] = {"role": "assistant", "content": message.get("content") or ""}
    else:
        chunk["object"] = "text_completion"
    chunk["choices"] = [choice]
    events = [b"data: " + orjson.dumps(chunk) + b"\n\n"]
    if req.include_usage and parsed.get("usage") is not None:
        usage = {**chunk, "choices": [], "usage": parsed["usage"]}
        events.append(b"data: " + orjson.dumps(usage) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return Answer(200, b"".join(events), "text/event-stream")
