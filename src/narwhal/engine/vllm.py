"""vLLM's NixlConnector PD protocol: the prefill body, the extracted handoff, the decode body.

Pure functions over JSON-shaped dicts, so the wire contract (DESIGN §1) is testable alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_STRIPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")

# Required handoff fields and the JSON types each must have (bool is not an int here).
_HANDOFF_FIELDS: dict[str, tuple[type, ...]] = {
    "remote_engine_id": (str,),
    "remote_block_ids": (list,),
    "remote_request_id": (str,),
    "remote_host": (str,),
    "remote_port": (int,),
}


@dataclass(frozen=True, slots=True)
class Handoff:
    """A readable handoff, exactly as the prefill engine returned it."""

    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Unreadable:
    """The prefill answered, but its handoff cannot be used (a kv_handoff failure)."""

    reason: str


@dataclass(frozen=True, slots=True)
class FinishedInPrefill:
    """The prefill's one token ended the request (EOS/stop): a complete answer, no decode."""


HandoffResult = Handoff | Unreadable | FinishedInPrefill


def prefill_body(client_body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking the engine to keep the KV."""
    body = {k: v for k, v in client_body.items() if k not in _STRIPPED_FOR_PREFILL}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
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


def _finish_reason(response: dict[str, Any]) -> Any:
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("finish_reason")
    return None


def extract_handoff(response: Any) -> HandoffResult:
    """Read the handoff from a prefill response, or say why it is unreadable."""
    if not isinstance(response, dict):
        return Unreadable("prefill response is not a JSON object")
    params = response.get("kv_transfer_params")
    if params is None and _finish_reason(response) == "stop":
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
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in params["remote_block_ids"]):
        return Unreadable("kv_transfer_params.remote_block_ids must be a list of integers")
    if not 0 < params["remote_port"] < 65536:
        return Unreadable("kv_transfer_params.remote_port out of range")
    return Handoff(dict(params))
