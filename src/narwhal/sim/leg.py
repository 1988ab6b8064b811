"""Which leg of a PD request a completion is, read from its `kv_transfer_params`."""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Leg(StrEnum):
    PREFILL = "prefill"  # do_remote_decode: run the prompt, keep its KV for a decode engine
    DECODE = "decode"  # do_remote_prefill: load the prompt's KV from a prefill engine
    UNIFIED = "unified"  # no handoff either way


def leg_of(kv_transfer_params: Any) -> Leg:
    """The leg a request asks for; if a body sets both flags, the decode (KV load) wins."""
    if not isinstance(kv_transfer_params, dict):
        return Leg.UNIFIED
    if kv_transfer_params.get("do_remote_prefill") is True:
        return Leg.DECODE
    if kv_transfer_params.get("do_remote_decode") is True:
        return Leg.PREFILL
    return Leg.UNIFIED
