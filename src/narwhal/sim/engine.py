"""The simulated engine: runs one completion as a unified, prefill or decode leg.

HTTP-free: takes a validated body and its leg, waits as the latency model says, and returns
what was generated plus the top-level fields of the answer (`kv_transfer_params`).
"""

from __future__ import annotations

import contextlib
import random
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from narwhal.clock import Clock
from narwhal.sim.config import KvRole, LoadFailurePolicy, SimConfig
from narwhal.sim.faults import FaultBook, FaultKind
from narwhal.sim.generation import Generated, generate
from narwhal.sim.handoff import GARBAGE_PARAMS, parse_handoff, produced_params
from narwhal.sim.kv import blocks_of, context_from_blocks
from narwhal.sim.kv_store import KvLoadError, KvStore
from narwhal.sim.latency import LatencyModel, Sleeper, pause
from narwhal.sim.leg import Leg
from narwhal.sim.metrics import SimMetrics
from narwhal.sim.requests import ChatBody, CompletionBody, RequestError
from narwhal.sim.side_channel import fetch_blocks


@dataclass(frozen=True, slots=True)
class Outcome:
    generated: Generated
    prompt_tokens: int
    cached_tokens: int  # prompt tokens loaded from a remote prefill's KV
    extra: dict[str, Any]  # top-level response fields
    itl_s: float  # the wait between two streamed tokens
    prompt_ids: tuple[int, ...] = ()


class SimEngine:
    def __init__(
        self,
        config: SimConfig,
        *,
        clock: Clock,
        rng: random.Random,
        sleeper: Sleeper,
        store: KvStore,
        faults: FaultBook,
        metrics: SimMetrics,
        side_channel_port: int,
    ) -> None:
        self.config = config
        self._clock = clock
        self._rng = rng
        self._sleeper = sleeper
        self._store = store
        self._faults = faults
        self._metrics = metrics
        self._side_channel_port = side_channel_port
        self._latency = LatencyModel(
            config.ttft_per_token_ms, config.itl_ms, config.transfer_per_block_ms
        )
        self.running = 0
        self.start_time = clock.wall()

    def new_id(self) -> str:
        return uuid.UUID(int=self._rng.getrandbits(128), version=4).hex

    def restart(self) -> None:
        """As if the process restarted: the KV is gone and the generation is strictly newer."""
        self._store.clear()
        self.start_time = max(self._clock.wall(), self.start_time + 1.0)

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Count a completion in flight; above `max_concurrency` it is refused with a 429."""
        if self.running >= self.config.max_concurrency:
            self._metrics.rejected.inc()
            raise RequestError(429, f"narwhal-sim is at --max-concurrency {self.running}")
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1

    async def complete(self, body: CompletionBody | ChatBody, leg: Leg, factor: float) -> Outcome:
        """Run the leg: TTFT (or the KV load), then generation; `factor` scales every wait."""
        prompt = body.prompt_ids()
        if not prompt:
            raise RequestError(400, "The decoder prompt cannot be empty", "prompt")
        if len(prompt) > self.config.max_model_len:
            raise RequestError(
                500,
                f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                f"length of {self.config.max_model_len}.",
            )
        context, cached = prompt, 0
        if leg is Leg.DECODE:
            context, cached = await self._load(body.kv_transfer_params or {}, prompt, factor)
        else:
            await pause(self._sleeper, self._latency.ttft_s(len(prompt), factor))
        generated = generate(context, body.token_limit, body.stop_strings, body.min_tokens)
        extra: dict[str, Any] = {"kv_transfer_params": None}
        if (
            leg is Leg.PREFILL
            and generated.finish_reason == "length"
            and self.config.kv_role is not KvRole.CONSUMER
        ):
            extra = self._produce(prompt, leg)
        return Outcome(
            generated, len(prompt), cached, extra, self._latency.itl_s(factor), tuple(prompt)
        )

    def _produce(self, prompt: Sequence[int], leg: Leg) -> dict[str, Any]:
        """Keep the prompt's KV for a decode engine and describe where to read it."""
        if self._faults.fire(FaultKind.HANDOFF_MISSING, leg):
            return {}
        if self._faults.fire(FaultKind.HANDOFF_GARBAGE, leg):
            return {"kv_transfer_params": dict(GARBAGE_PARAMS)}
        request_id = self.new_id()
        block_ids = self._store.put(request_id, blocks_of(prompt))
        params = produced_params(
            self.config.engine_id,
            request_id,
            block_ids,
            self.config.advertised_host,
            self._side_channel_port,
        )
        return {"kv_transfer_params": params}

    async def _load(
        self, params: dict[str, Any], prompt: list[int], factor: float
    ) -> tuple[list[int], int]:
        """The decode leg's context and its count of remotely loaded prompt tokens."""
        if self.config.kv_role is KvRole.PRODUCER:
            raise RequestError(500, "KV transfer not permitted for kv_producer")
        try:
            blocks = await fetch_blocks(parse_handoff(params), self.config.kv_load_timeout_s)
        except KvLoadError as exc:
            self._metrics.kv_load_failures.inc()
            if self.config.kv_load_failure_policy is LoadFailurePolicy.FAIL:
                raise RequestError(500, f"KV load failed: {exc}") from exc
            self._metrics.kv_recomputes.inc()
            await pause(self._sleeper, self._latency.ttft_s(len(prompt), factor))
            return prompt, 0
        self._metrics.kv_blocks_received.inc(len(blocks))
        await pause(self._sleeper, self._latency.transfer_s(len(blocks), factor))
        loaded = sum(len(b) for b in blocks)
        return context_from_blocks(blocks, prompt), min(loaded, len(prompt))
