"""One adapter per engine API, shared by the data plane, probes, health and readmission."""

from __future__ import annotations

from narwhal.clock import Clock
from narwhal.config import EngineConfig
from narwhal.engine.adapter import Adapter
from narwhal.engine.llamacpp import LlamaCppAdapter
from narwhal.engine.resumptions import Resumptions
from narwhal.engine.transport import EngineClient
from narwhal.engine.vllm import VllmAdapter


class Adapters:
    def __init__(self, client: EngineClient, clock: Clock, control_timeout_s: float) -> None:
        self._by_api: dict[str, Adapter] = {
            "vllm": VllmAdapter(client, control_timeout_s),
            "llamacpp": LlamaCppAdapter(client, clock, control_timeout_s),
        }
        self.resumptions = Resumptions(clock)

    def observe_health(self, engine: EngineConfig, answered: bool) -> None:
        """A health answer or silence, shown to the engine's adapter and to `resumptions`."""
        self(engine).observe_health(engine.id, answered)
        self.resumptions.observe(engine.id, answered)

    def __call__(self, engine: EngineConfig) -> Adapter:
        return self._by_api[engine.api]

    def of_api(self, api: str) -> Adapter:
        return self._by_api[api]
