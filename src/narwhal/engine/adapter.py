"""The engine-protocol seam: what differs between engine APIs, behind one interface.

An adapter owns how a prefill leg and a decode leg are sent, what the extracted handoff is
and when it is unreadable, and how an engine's process generation is read. Placement,
evidence, holds, probes and readmission are the same for every API (docs/engines.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from narwhal.config import EngineConfig
from narwhal.engine.transport import PoolKind

Endpoint = Literal["completions", "chat"]
PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# Client fields that do not apply to a one-token, non-streamed prefill.
_STRIPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def one_token_body(client_body: dict[str, Any]) -> dict[str, Any]:
    """What every API's prefill leg starts from: the client's body, one token, not streamed."""
    body = {k: v for k, v in client_body.items() if k not in _STRIPPED_FOR_PREFILL}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    return body


def finished_in_prefill(response: Any) -> bool:
    """The prefill's one token ended the request (`finish_reason: "stop"`)."""
    choices = response.get("choices") if isinstance(response, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("finish_reason") == "stop"
    return False


@dataclass(frozen=True, slots=True)
class Unreadable:
    """The prefill answered, but its handoff cannot be used (a kv_handoff failure)."""

    reason: str


@dataclass(frozen=True, slots=True)
class FinishedInPrefill:
    """The prefill's one token ended the request (EOS/stop): a complete answer, no decode."""


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """The prefill engine's answer; `result` is set only when it answered 200."""

    status: int
    body: bytes
    content_type: str
    parsed: Any = None
    result: object | None = None  # an adapter's handoff, Unreadable or FinishedInPrefill


class HandoffRefused(Exception):
    """The decode engine could not use the handoff: a kv_handoff failure of its producer."""


class SlotsBusy(Exception):
    """No engine slot came free in time: the router's own saturation, not engine evidence."""


# How an engine API tells a stream's token ids (`Adapter.token_ids_by`; used by migration).
BY_RETURN_TOKEN_IDS, BY_LOGPROBS = "return_token_ids", "logprobs"


class Adapter(Protocol):
    # True when only the decode can tell whether a handoff was usable (it refuses it, or
    # recomputes the prompt): the prefill's success then waits for the decode's verdict.
    decode_verifies_handoff: bool
    # How a stream tells its token ids, for migration (`dataplane/migration.py`):
    # `return_token_ids` (vLLM) or `logprobs` (llama.cpp).
    token_ids_by: str

    async def prefill(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        endpoint: Endpoint,
        client_body: dict[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> PrefillReply:
        """Run the prefill leg; raises EngineFailure on transport trouble."""
        ...

    def decode(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        client_body: dict[str, Any],
        handoff: object,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> AbstractAsyncContextManager[dict[str, Any]]:
        """Prepare the decode engine for `handoff`; yields the body to POST to it.

        Raises HandoffRefused when the decode engine cannot use the handoff, EngineFailure
        on transport trouble with the decode engine, SlotsBusy when it has no free slot.
        """
        ...

    def unified_body(self, client_body: dict[str, Any]) -> dict[str, Any]:
        """The body for a whole request on an engine with role `both`."""
        ...

    async def rendered_chat(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        chat_body: dict[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> str | None:
        """The chat's prompt as the engine's template renders it, for a migrated chat when
        the stream gave no prompt ids (None where they always come with the stream)."""
        ...

    def recomputed(self, final_event: bytes | None) -> str | None:
        """Why the decode evidently did not use the handoff (from its last event), or None."""
        ...

    async def discard(self, producer: EngineConfig, handoff: object) -> None:
        """The handoff is used at most once: release whatever it holds."""
        ...

    def observe_health(self, engine_id: str, answered: bool) -> None:
        """Every health answer (True) or silence (False), for adapters that need it."""
        ...

    async def learn(self, engine: EngineConfig) -> None:
        """Read what the adapter needs to know about a healthy engine (cheap when known)."""
        ...

    async def generation(self, engine: EngineConfig) -> tuple[float | None, str]:
        """The engine's process generation, or None and why it cannot be read."""
        ...
