"""What a request to an engine needs besides its body: the engine's API key, read once per
engine config (`api_key_env` reads the environment), and the one client call that requests
outside an attempt's legs make (a token count, a rendered prompt, a `/tokenize` passthrough).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from narwhal.config import EngineConfig
from narwhal.engine.transport import PoolKind, Reply

KeyOf = Callable[[EngineConfig], "str | None"]
"""An engine's API key (`EngineKeys.of`)."""


class EngineKeys:
    """Each engine's API key by id, with the config it was read from (members change: a new
    config for the same id reads the key again)."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[EngineConfig, str | None]] = {}

    def of(self, config: EngineConfig) -> str | None:
        cached = self._by_id.get(config.id)
        if cached is None or cached[0] is not config:
            cached = self._by_id[config.id] = (config, config.resolved_api_key())
        return cached[1]


class Post(Protocol):
    """`EngineClient.post`: a whole request and its whole reply; `EngineFailure` on transport
    trouble."""

    async def post(
        self, pool: PoolKind, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> Reply: ...
