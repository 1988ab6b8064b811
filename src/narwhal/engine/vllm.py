"""vLLM's NixlConnector PD protocol: the prefill body, the extracted handoff, the decode body.

Pure functions over JSON-shaped dicts, so the wire contract (DESIGN §1) is testable alone,
and the adapter that sends them.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson

from narwhal.config import EngineConfig
from narwhal.engine.adapter import (
    BY_RETURN_TOKEN_IDS,
    PATHS,
    Endpoint,
    FinishedInPrefill,
    PrefillReply,
    Unreadable,
    finished_in_prefill,
    one_token_body,
)
from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.engine.transport import EngineClient, PoolKind, control_get

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# The handoff's fields (DESIGN §1) and the JSON type of each (bool is not an int here).
# `remote_request_id` is required as DESIGN lists it (vLLM's NixlConnector has sent it since
# it names the prefill's request to the decode); `tp_size` is type-checked only when present;
# everything else passes through to the decode unchanged.
_HANDOFF_FIELDS: dict[str, tuple[type, ...]] = {
    "remote_engine_id": (str,),
    "remote_block_ids": (list,),
    "remote_request_id": (str,),
    "remote_host": (str,),
    "remote_port": (int,),
}
_OPTIONAL_HANDOFF_FIELDS: dict[str, tuple[type, ...]] = {
    "tp_size": (int,),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_ids_readable(block_ids: list[Any]) -> bool:
    """A flat list of ints, or a list of lists of ints (one per KV cache group, as
    connectors for hybrid models send)."""
    if all(_is_int(b) for b in block_ids):
        return True
    return all(isinstance(g, list) and all(_is_int(b) for b in g) for g in block_ids)


@dataclass(frozen=True, slots=True)
class Handoff:
    """A readable handoff, exactly as the prefill engine returned it."""

    params: dict[str, Any]


HandoffResult = Handoff | Unreadable | FinishedInPrefill


def prefill_body(client_body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking the engine to keep the KV."""
    body = one_token_body(client_body)
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return body


def decode_body(client_body: dict[str, Any], handoff: Handoff) -> dict[str, Any]:
    """The decode leg's body: the client's body plus the extracted handoff."""
    body = dict(client_body)
    body["kv_transfer_params"] = handoff.params
    return body


def strip_client_kv_params(client_body: dict[str, Any]) -> dict[str, Any]:
    """A client must not steer KV reads to hosts of its choosing."""
    if "kv_transfer_params" not in client_body:
        return client_body
    return {k: v for k, v in client_body.items() if k != "kv_transfer_params"}


def extract_handoff(response: Any) -> HandoffResult:
    """Read the handoff from a prefill response, or say why it is unreadable."""
    if not isinstance(response, dict):
        return Unreadable("prefill response is not a JSON object")
    params = response.get("kv_transfer_params")
    if params is None and finished_in_prefill(response):
        return FinishedInPrefill()
    if "kv_transfer_params" not in response:
        return Unreadable("kv_transfer_params missing")
    if not isinstance(params, dict):
        return Unreadable(f"kv_transfer_params is {type(params).__name__}, not an object")
    if params.get("do_remote_prefill") is not True:
        return Unreadable("kv_transfer_params.do_remote_prefill is not true")
    for name, types in _HANDOFF_FIELDS.items():
        if name not in params or params[name] is None:
            return Unreadable(f"kv_transfer_params.{name} missing")
        value = params[name]
        if not isinstance(value, types) or isinstance(value, bool):
            return Unreadable(f"kv_transfer_params.{name} has the wrong type")
    for name, types in _OPTIONAL_HANDOFF_FIELDS.items():
        value = params.get(name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            return Unreadable(f"kv_transfer_params.{name} has the wrong type")
    if not _block_ids_readable(params["remote_block_ids"]):
        return Unreadable(
            "kv_transfer_params.remote_block_ids must be a list of integers or of integer lists"
        )
    if not 0 < params["remote_port"] < 65536:
        return Unreadable("kv_transfer_params.remote_port out of range")
    return Handoff(dict(params))


_START_TIME = re.compile(rb"^process_start_time_seconds\s+([0-9.eE+]+)\s*$", re.M)


def parse_generation(metrics_text: bytes) -> float | None:
    """The process generation: `process_start_time_seconds` from Prometheus text."""
    match = _START_TIME.search(metrics_text)
    return float(match[1]) if match else None


class VllmAdapter:
    """vLLM with the NixlConnector: the handoff travels in the decode body; nothing to free."""

    decode_verifies_handoff = False  # an unreadable handoff is visible in the prefill's answer
    token_ids_by = BY_RETURN_TOKEN_IDS

    def __init__(self, client: EngineClient, control_timeout_s: float) -> None:
        self._client = client
        self._timeout_s = control_timeout_s

    async def prefill(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        endpoint: Endpoint,
        client_body: dict[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> PrefillReply:
        reply = await self._client.post(
            pool,
            engine.url + PATHS[endpoint],
            orjson.dumps(prefill_body(client_body)),
            headers,
            timeout_s,
            timeout_class=FailureClass.STREAM,
        )
        if reply.status != 200:
            return PrefillReply(reply.status, reply.body, reply.content_type)
        try:
            parsed = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            parsed = None
        return PrefillReply(
            reply.status, reply.body, reply.content_type, parsed, extract_handoff(parsed)
        )

    @asynccontextmanager
    async def decode(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        client_body: dict[str, Any],
        handoff: object,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> AsyncIterator[dict[str, Any]]:
        assert isinstance(handoff, Handoff)
        yield decode_body(client_body, handoff)

    def unified_body(self, client_body: dict[str, Any]) -> dict[str, Any]:
        return client_body

    async def rendered_chat(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        chat_body: dict[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> str | None:
        """Never needed: vLLM gives a chat's prompt ids in the stream's first chunk."""
        return None

    def recomputed(self, final_event: bytes | None) -> str | None:
        return None  # vLLM reports nothing per request; unreadable handoffs are refused earlier

    async def discard(self, producer: EngineConfig, handoff: object) -> None:
        return None  # the prefill engine frees unclaimed blocks on its own timeout

    def observe_health(self, engine_id: str, answered: bool) -> None:
        return None

    async def learn(self, engine: EngineConfig) -> None:
        return None

    async def generation(self, engine: EngineConfig) -> tuple[float | None, str]:
        try:
            reply = await control_get(self._client, engine, "/metrics", self._timeout_s)
        except EngineFailure as exc:
            return None, f"cannot read /metrics: {exc.detail}"
        generation = parse_generation(reply.body)
        if generation is None:
            return None, "process_start_time_seconds missing from /metrics"
        return generation, "process_start_time_seconds"
