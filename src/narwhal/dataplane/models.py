"""`GET /v1/models`: the models this router can serve now (each with an eligible engine for
every role it needs, DESIGN §10), in the OpenAI list shape, with vLLM's `max_model_len`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from narwhal.fleet.store import ModelCard


def models_list(cards: Sequence[ModelCard]) -> dict[str, Any]:
    data = []
    for card in cards:
        entry: dict[str, Any] = {
            "id": card.id,
            "object": "model",
            "owned_by": "narwhal",
            "created": card.created,
        }
        if card.max_model_len is not None:
            entry["max_model_len"] = card.max_model_len
        data.append(entry)
    return {"object": "list", "data": data}
