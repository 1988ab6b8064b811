"""The simulated engine: runs one completion as a unified, prefill or decode leg.

HTTP-free: takes a validated body and its leg, waits its turn (the scheduler), waits as the
latency model says (a prefill pays for the prompt tokens its prefix cache lacks), and yields
what was generated plus the top-level fields of the answer (`kv_transfer_params`) while the
request still holds its place and KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from narwhal.clock import Clock
from narwhal.sim.config import KvRole, LoadFailurePolicy, SimConfig
from narwhal.sim.faults import FaultBook, FaultKind
from narwhal.sim.generation import Generated, generate
from narwhal.sim.handoff import GARBAGE_PARAMS, parse_handoff, produced_params
from narwhal.sim.kv import blocks_of, context_from_blocks
from narwhal.sim.kv_events import KvEvent
from narwhal.sim.kv_store import KvLoadError, KvStore
from narwhal.sim.latency import LatencyModel, Sleeper, pause
from narwhal.sim.leg import Leg
from narwhal.sim.metrics import SimMetrics
from narwhal.sim.prefix_cache import Allocation, BlockExtras, PrefixCache
from narwhal.sim.requests import ChatBody, CompletionBody, RequestError
from narwhal.sim.scheduler import Scheduler
from narwhal.sim.side_channel import fetch_blocks
from narwhal.sim.tokens import WORDS, Tokenizer

EventSink = Callable[[Sequence[KvEvent]], None]


def _no_events(events: Sequence[KvEvent]) -> None:
    pass


@dataclass(frozen=True, slots=True)
class _Admission:
    """What a running request holds: its prefix-cache allocation (None: no cache)."""

    alloc: Allocation | None

    @property
    def hit_tokens(self) -> int:
        return 0 if self.alloc is None else self.alloc.hit_tokens


@dataclass(frozen=True, slots=True)
class Outcome:
    generated: Generated
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache or loaded from a prefill
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
        cache: PrefixCache | None = None,
        publish: EventSink = _no_events,
        tokenizer: Tokenizer = WORDS,
    ) -> None:
        self.config = config
        self._clock = clock
        self._rng = rng
        self._sleeper = sleeper
        self._store = store
        self._faults = faults
        self._metrics = metrics
        self._side_channel_port = side_channel_port
        self._cache = cache
        self._publish = publish
        self.tokenizer = tokenizer
        self._scheduler = Scheduler(config.max_num_seqs)
        # one prompt computed at a time (`serial_prefill`); asyncio's lock is first come first
        # served, as vLLM's scheduler fills a step's token budget
        self._compute = asyncio.Lock() if config.serial_prefill else None
        self._latency = LatencyModel(
            config.ttft_per_token_ms, config.itl_ms, config.transfer_per_block_ms
        )
        self.in_flight = 0  # completions between arrival and their answer's end
        self.start_time = clock.wall()

    @property
    def waiting(self) -> int:
        """Completions waiting for a running slot or KV blocks (vLLM's waiting queue)."""
        return self._scheduler.waiting

    @property
    def running(self) -> int:
        """Completions in the engine and not waiting (a stalled one counts: it holds a slot
        as far as a client can tell)."""
        return self.in_flight - self._scheduler.waiting

    def kv_cache_usage(self) -> float:
        return 0.0 if self._cache is None else self._cache.usage()

    def new_id(self) -> str:
        return uuid.UUID(int=self._rng.getrandbits(128), version=4).hex

    def restart(self) -> None:
        """As if the process restarted: the KV is gone and the generation is strictly newer.
        A new process publishes no `AllBlocksCleared`: its subscribers learn of the restart
        from its event sequence starting again."""
        self._store.clear()
        if self._cache is not None:
            self._cache.clear()
        self.start_time = max(self._clock.wall(), self.start_time + 1.0)

    def cached_prefix(self, body: CompletionBody | ChatBody) -> tuple[int, int] | None:
        """(prompt tokens, of which cached now) for a request's prompt; None without a cache.
        Changes nothing: the benchmark's oracle asks every engine before placing."""
        if self._cache is None:
            return None
        prompt = body.prompt_ids(self.tokenizer)
        return len(prompt), self._cache.match(prompt, self._extras(body))

    def reset_prefix_cache(self) -> bool:
        """vLLM's `/reset_prefix_cache`: drop every cached block; False without a cache."""
        if self._cache is None:
            return False
        self._publish(self._cache.clear())
        return True

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Count a completion in flight; above `max_concurrency` it is refused with a 429."""
        if self.in_flight >= self.config.max_concurrency:
            self._metrics.rejected.inc()
            raise RequestError(429, f"narwhal-sim is at --max-concurrency {self.in_flight}")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @contextlib.asynccontextmanager
    async def complete(
        self, body: CompletionBody | ChatBody, leg: Leg, factor: float
    ) -> AsyncIterator[Outcome]:
        """Run the leg once its turn comes: TTFT for the uncached prompt tokens (or the KV
        load), then generation; `factor` scales every wait. The request keeps its running slot
        and KV blocks until the caller leaves the context (its answer is written)."""
        prompt = body.prompt_ids(self.tokenizer)
        if not prompt:
            raise RequestError(400, "The decoder prompt cannot be empty", "prompt")
        if len(prompt) > self.config.max_model_len:
            raise RequestError(
                500,
                f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                f"length of {self.config.max_model_len}.",
            )
        extras = self._extras(body)
        async with self._scheduler.slot(lambda: self._admit(prompt, extras), self._release) as adm:
            if leg is Leg.DECODE:
                params = body.kv_transfer_params or {}
                context, cached = await self._load(params, prompt, factor, adm)
            else:
                context, cached = prompt, adm.hit_tokens
                await self._prefill(len(prompt) - cached, factor)
                self._stored(adm)
            generated = generate(context, body.token_limit, body.stop_strings, body.min_tokens)
            extra: dict[str, Any] = {"kv_transfer_params": None}
            if (
                leg is Leg.PREFILL
                and generated.finish_reason == "length"
                and self.config.kv_role is not KvRole.CONSUMER
            ):
                extra = self._produce(prompt, leg)
            yield Outcome(
                generated, len(prompt), cached, extra, self._latency.itl_s(factor), tuple(prompt)
            )

    async def _prefill(self, tokens: int, factor: float) -> None:
        """Compute `tokens` prompt tokens: alone on the engine with `serial_prefill`."""
        async with self._compute or contextlib.nullcontext():
            await pause(self._sleeper, self._latency.ttft_s(tokens, factor))

    # --- the prefix cache -------------------------------------------------------------------

    def _extras(self, body: CompletionBody | ChatBody) -> BlockExtras:
        lora = body.model if body.model in self.config.lora else None
        lora_id = self.config.lora.index(lora) + 1 if lora else None
        return BlockExtras(lora_name=lora, lora_id=lora_id, cache_salt=body.cache_salt)

    def _admit(self, prompt: list[int], extras: BlockExtras) -> _Admission | None:
        """The request's KV blocks, its cached prefix referenced; None: they do not fit yet."""
        if self._cache is None:
            return _Admission(None)
        got = self._cache.allocate(prompt, extras)
        if got is None:
            return None
        alloc, evicted = got
        self._publish(evicted)
        self._metrics.count_prefix_lookup(len(prompt), alloc.hit_tokens)
        return _Admission(alloc)

    def _stored(self, adm: _Admission) -> None:
        """The prompt's blocks are computed (or loaded): they enter the cache."""
        if self._cache is not None and adm.alloc is not None:
            self._publish(self._cache.store(adm.alloc))

    def _release(self, adm: _Admission) -> None:
        if self._cache is not None and adm.alloc is not None:
            self._cache.release(adm.alloc)

    def _produce(self, prompt: Sequence[int], leg: Leg) -> dict[str, Any]:
        """Keep the prompt's KV for a decode engine and describe where to read it."""
        if self._faults.fire(FaultKind.HANDOFF_MISSING, leg):
            return {}
        if self._faults.fire(FaultKind.HANDOFF_GARBAGE, leg):
            return {"kv_transfer_params": dict(GARBAGE_PARAMS)}
        request_id = self.new_id()
        block_ids = self._store.put(request_id, blocks_of(prompt, self.config.block_size))
        params = produced_params(
            self.config.engine_id,
            request_id,
            block_ids,
            self.config.advertised_host,
            self._side_channel_port,
        )
        return {"kv_transfer_params": params}

    async def _load(
        self, params: dict[str, Any], prompt: list[int], factor: float, adm: _Admission
    ) -> tuple[list[int], int]:
        """The decode leg's context and its count of loaded (or locally cached) prompt tokens.
        Loaded blocks enter this engine's cache when they hold the prompt (a handoff of another
        context is used, as vLLM would, but not cached under this prompt's keys)."""
        if self.config.kv_role is KvRole.PRODUCER:
            raise RequestError(500, "KV transfer not permitted for kv_producer")
        try:
            blocks = await fetch_blocks(parse_handoff(params), self.config.kv_load_timeout_s)
        except KvLoadError as exc:
            self._metrics.kv_load_failures.inc()
            if self.config.kv_load_failure_policy is LoadFailurePolicy.FAIL:
                raise RequestError(500, f"KV load failed: {exc}") from exc
            self._metrics.kv_recomputes.inc()
            hit = adm.hit_tokens
            await self._prefill(len(prompt) - hit, factor)
            self._stored(adm)
            return prompt, hit
        self._metrics.kv_blocks_received.inc(len(blocks))
        await pause(self._sleeper, self._latency.transfer_s(len(blocks), factor))
        context = context_from_blocks(blocks, prompt)
        if context[: len(prompt)] == prompt:
            self._stored(adm)
        loaded = sum(len(b) for b in blocks)
        return context, min(loaded, len(prompt))
