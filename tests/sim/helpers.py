"""Small helpers for the simulator tests: request bodies, SSE parsing, socket probes."""

from __future__ import annotations

import json
import socket
from typing import Any

from tests.support.sim_process import SimProcess

PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The router's prefill leg (DESIGN §1): one token, not streamed, keep the KV."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    return out | {"max_tokens": 1, "stream": False, "kv_transfer_params": dict(PREFILL_KV)}


def decode_body(body: dict[str, Any], params: Any) -> dict[str, Any]:
    return body | {"kv_transfer_params": params}


def post(sim: SimProcess, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    """POST JSON; returns (status, decoded JSON or the raw text)."""
    status, raw = sim.http("POST", path, body, headers=headers)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def complete(sim: SimProcess, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    """A non-streaming completion that must succeed."""
    status, answer = post(sim, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def text_of(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def sse_data(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    out = []
    for event in raw.decode().split("\n\n"):
        if event.strip():
            assert event.startswith("data: "), event
            out.append(event[len("data: ") :])
    return out


def stream_text(payloads: list[str]) -> str:
    """The text a stream delivered (chat deltas or completion text)."""
    parts = []
    for data in payloads:
        if data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            delta = choice.get("delta")
            parts.append((delta.get("content") or "") if delta is not None else choice["text"])
    return "".join(parts)


def connect_refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
