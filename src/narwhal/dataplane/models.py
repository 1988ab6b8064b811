"""`GET /v1/models`: the one model this router serves, in the OpenAI list shape."""

from __future__ import annotations

from typing import Any


def models_list(model: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "owned_by": "narwhal", "created": 0}],
    }
