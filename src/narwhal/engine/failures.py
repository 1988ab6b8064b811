"""The failure taxonomy: every engine failure is one of the spec's six classes.

Transport errors are mapped to a class once, at the edge (`classify_*`); everything above
works with `EngineFailure` and `FailureClass` only. Successes are `SuccessKind`s, and
`CLEARS` is the spec's "Clearing failure evidence" table.
"""

from __future__ import annotations

import re
from enum import StrEnum


class FailureClass(StrEnum):
    CONNECTION = "connection"
    TIMEOUT = "timeout"
    STREAM = "stream"
    OVERLOAD = "overload"
    INFERENCE_STATUS = "inference_status"
    KV_HANDOFF = "kv_handoff"


class SuccessKind(StrEnum):
    CLIENT_4XX = "client_4xx"
    HEALTH_OK = "health_ok"
    PREFILL_HANDOFF = "prefill_handoff"
    PREFILL_FINISHED = "prefill_finished"
    DECODE_DONE = "decode_done"
    EMBEDDED = "embedded"  # an embed engine answered 200


CLEARS: dict[SuccessKind, frozenset[FailureClass]] = {
    SuccessKind.CLIENT_4XX: frozenset({FailureClass.CONNECTION, FailureClass.INFERENCE_STATUS}),
    SuccessKind.HEALTH_OK: frozenset(
        {FailureClass.CONNECTION, FailureClass.TIMEOUT, FailureClass.OVERLOAD}
    ),
    SuccessKind.PREFILL_HANDOFF: frozenset(
        {FailureClass.CONNECTION, FailureClass.INFERENCE_STATUS, FailureClass.KV_HANDOFF}
    ),
    # The prefill's one token completed the request: a 2xx without a handoff to extract, so
    # it clears what any client-visible success clears, but not kv_handoff evidence.
    SuccessKind.PREFILL_FINISHED: frozenset(
        {FailureClass.CONNECTION, FailureClass.INFERENCE_STATUS}
    ),
    SuccessKind.DECODE_DONE: frozenset(
        {FailureClass.CONNECTION, FailureClass.INFERENCE_STATUS, FailureClass.STREAM}
    ),
    # A whole embeddings answer: a client-visible success with no stream or handoff in it.
    SuccessKind.EMBEDDED: frozenset({FailureClass.CONNECTION, FailureClass.INFERENCE_STATUS}),
}
"""What each success clears. Health 200 also resets the separate liveness counter."""

INFERENCE_CLASSES = frozenset(
    {FailureClass.STREAM, FailureClass.INFERENCE_STATUS, FailureClass.KV_HANDOFF}
)
"""Classes answered with an inference-verification hold and an inference probe."""


class EngineFailure(Exception):
    """A failure attributable to one engine, already classified."""

    def __init__(
        self,
        failure_class: FailureClass,
        detail: str,
        *,
        status: int | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(f"{failure_class.value}: {detail}")
        self.failure_class = failure_class
        self.detail = detail
        self.status = status
        self.timed_out = timed_out  # a deadline ran out: the client gets a gateway timeout


class ClientError(Exception):
    """An engine's 4xx other than 408/429: the client's fault, passed through verbatim."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


def classify_status(status: int, body: bytes = b"") -> FailureClass | None:
    """Map a non-2xx HTTP status (and, for a 500, its body) to its class; None means a
    client error."""
    if status in (408, 429):
        return FailureClass.OVERLOAD
    if 400 <= status < 500 or (status == 500 and prompt_too_long(body)):
        return None
    return FailureClass.INFERENCE_STATUS


# vLLM's words for a prompt longer than the model allows; some versions answer it with a 500.
_PROMPT_TOO_LONG = re.compile(
    rb"is longer than the maximum model length|maximum context length is \d+ tokens"
)


def prompt_too_long(body: bytes) -> bool:
    """Whether an engine's error body says the prompt exceeds the model's length.

    vLLM answers that case with a 500 (DESIGN §1). The router's own length check stops such
    prompts first, but cannot when it does not know the limit yet or cannot count (the
    counting engine is down): then the engine's answer is still the client's error, never
    evidence against the engine that judged it correctly."""
    return _PROMPT_TOO_LONG.search(body[:4096]) is not None
