"""`GET /v1/models`: the models this router can serve now (each with an eligible engine for
every role it needs, DESIGN §10), in the OpenAI list shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def models_list(models: Sequence[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "owned_by": "narwhal", "created": 0} for m in models],
    }
