"""llama.cpp's `llama-server`: prefill/decode through slot files (docs/engines.md).

Prefill: the request runs with one token on a slot the router owns (`id_slot`,
`cache_prompt`), then `POST /slots/{id}?action=save` writes that slot's KV cache to a file
named by the router; the handoff is the file name and its token count. Decode: `POST
/slots/{id}?action=restore` loads the file into a free slot of the decode server, and the
client's request continues there, evaluating only the last prompt token. Both servers must
share one `--slot-save-path` and run with `--swa-full` (otherwise a restore reports success
and the server silently recomputes, which `recomputed` detects from the final `timings`).

Process generation: llama-server exposes no start time, so the generation is the wall time
at which the router first saw the engine answer after silence (or at all); a restart faster
than one health sweep goes unnoticed (documented limit).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from narwhal.clock import Clock
from narwhal.config import EngineConfig
from narwhal.engine.adapter import (
    BY_LOGPROBS,
    PATHS,
    Endpoint,
    FinishedInPrefill,
    HandoffRefused,
    PrefillReply,
    SlotsBusy,
    Unreadable,
    finished_in_prefill,
    one_token_body,
)
from narwhal.engine.failures import EngineFailure, FailureClass, classify_status
from narwhal.engine.slots import SlotPool
from narwhal.engine.transport import EngineClient, PoolKind, control_get

log = logging.getLogger("narwhal.llamacpp")

# Client fields that would steer the engine's slots or KV: the router owns those.
_ROUTER_OWNED = ("id_slot", "cache_prompt", "kv_transfer_params", "n_predict")


@dataclass(frozen=True, slots=True)
class SlotHandoff:
    """A saved slot: the file (relative to `--slot-save-path`) and its token count."""

    filename: str
    n_tokens: int


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """What a slot file's shape depends on: `--parallel` and the context per slot."""

    slots: int
    ctx_per_slot: int | None


def read_layout(props: Any) -> SlotLayout | None:
    """The layout from a `/props` answer, or None when it does not say."""
    if not isinstance(props, dict):
        return None
    total = props.get("total_slots")
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        return None
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return SlotLayout(total, n_ctx if isinstance(n_ctx, int) else None)


def layout_conflict(layouts: Mapping[str, SlotLayout]) -> str | None:
    """Why slot files will not restore across these servers, or None when they can."""
    if len(set(layouts.values())) <= 1:
        return None
    shapes = ", ".join(
        f"{engine_id} {layout.slots} slots x {layout.ctx_per_slot} ctx"
        for engine_id, layout in sorted(layouts.items())
    )
    return (
        f"llama.cpp servers differ in --parallel or --ctx-size ({shapes}): a slot file "
        "restores only into a server with the same layout, so handoffs will be refused"
    )


def clean_body(client_body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in client_body.items() if k not in _ROUTER_OWNED}


def prefill_body(client_body: dict[str, Any], slot: int) -> dict[str, Any]:
    """One token, not streamed, on the router's slot, keeping the prompt's KV in that slot."""
    body = one_token_body(clean_body(client_body))
    body["id_slot"] = slot
    body["cache_prompt"] = True
    return body


def prompt_content(client_body: dict[str, Any]) -> str | None:
    """What a prefill evaluates, as text whose prefixes follow the prompt's: the prompt
    itself, or the chat's messages serialised in order (a longer conversation extends the
    shorter one's text up to its closing bracket). None when there is neither."""
    prompt = client_body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    value = prompt if prompt is not None else client_body.get("messages")
    if value is None:
        return None
    return orjson.dumps(value).decode()


def decode_body(client_body: dict[str, Any], slot: int) -> dict[str, Any]:
    body = clean_body(client_body)
    body["id_slot"] = slot
    body["cache_prompt"] = True
    return body


def saved_tokens(status: int, body: bytes) -> int | Unreadable:
    """The token count from a slot-save reply, or why the save produced no usable file."""
    if status != 200:
        return Unreadable(f"slot save answered HTTP {status}: {_message(body)}")
    try:
        n = orjson.loads(body).get("n_saved")
    except (orjson.JSONDecodeError, AttributeError):
        return Unreadable("slot save reply is not a JSON object")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return Unreadable(f"slot save reply has no positive n_saved: {n!r}")
    return n


def recomputed(final_event: bytes | None) -> str | None:
    """The decode's last event says how many prompt tokens it evaluated; more than the last
    one means the restored KV cache was not used (the prompt was silently recomputed)."""
    if final_event is None:
        return None
    payload = final_event.removeprefix(b"data: ")
    try:
        timings = orjson.loads(payload).get("timings")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    prompt_n = timings.get("prompt_n") if isinstance(timings, dict) else None
    if isinstance(prompt_n, int) and prompt_n > 1:
        cached = timings.get("cache_n")
        return (
            f"decode recomputed the prompt: evaluated {prompt_n} prompt tokens, "
            f"{cached} from the restored cache"
        )
    return None


def _message(body: bytes) -> str:
    try:
        error = orjson.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        return str(message)[:200]
    except (orjson.JSONDecodeError, AttributeError):
        return body[:200].decode("utf-8", "replace")


async def _unlink(path: Path) -> None:
    with suppress(FileNotFoundError):
        await asyncio.to_thread(os.unlink, path)


class LlamaCppAdapter:
    decode_verifies_handoff = True  # a slot file is judged only when the decode restores it
    # Its OpenAI answers carry no token ids, but each token's logprob carries its id.
    token_ids_by = BY_LOGPROBS

    def __init__(self, client: EngineClient, clock: Clock, control_timeout_s: float) -> None:
        self._client = client
        self._clock = clock
        self._timeout_s = control_timeout_s
        self._slots: dict[str, SlotPool] = {}
        self._sized: set[str] = set()
        self._layouts: dict[str, SlotLayout] = {}
        self._answering: dict[str, bool] = {}
        self._generations: dict[str, float] = {}
        self._files = itertools.count()

    def slots(self, engine_id: str) -> SlotPool:
        pool = self._slots.get(engine_id)
        if pool is None:
            pool = self._slots[engine_id] = SlotPool(1)
        return pool

    async def _slot(self, engine: EngineConfig, timeout_s: float, content: str | None) -> int:
        try:
            return await self.slots(engine.id).acquire(timeout_s, content)
        except TimeoutError:
            raise SlotsBusy(f"no free slot on {engine.id}") from None

    async def _post(
        self, pool: PoolKind, url: str, body: dict[str, Any], headers: Mapping[str, str], t: float
    ) -> tuple[int, bytes, str]:
        reply = await self._client.post(
            pool, url, orjson.dumps(body), headers, t, timeout_class=FailureClass.STREAM
        )
        return reply.status, reply.body, reply.content_type

    async def prefill(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        endpoint: Endpoint,
        client_body: dict[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> PrefillReply:
        deadline = self._clock.monotonic() + timeout_s
        slot = await self._slot(engine, timeout_s, prompt_content(client_body))
        try:
            status, body, content_type = await self._post(
                pool,
                engine.url + PATHS[endpoint],
                prefill_body(client_body, slot),
                headers,
                max(0.0, deadline - self._clock.monotonic()),
            )
            if status != 200:
                return PrefillReply(status, body, content_type)
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:
                return PrefillReply(status, body, content_type, None, Unreadable("not JSON"))
            if finished_in_prefill(parsed):
                return PrefillReply(status, body, content_type, parsed, FinishedInPrefill())
            request_id = str(headers.get("X-Request-Id") or "narwhal")
            filename = f"{request_id}-{next(self._files)}.bin"
            try:
                save_status, save_body, _ = await self._post(
                    pool,
                    f"{engine.url}/slots/{slot}?action=save",
                    {"filename": filename},
                    headers,
                    max(0.0, deadline - self._clock.monotonic()),
                )
            except BaseException:  # cancelled or failed mid-save: the file may exist anyway
                await self.discard(engine, SlotHandoff(filename, 0))
                raise
            n = saved_tokens(save_status, save_body)
            if isinstance(n, Unreadable):
                await self.discard(engine, SlotHandoff(filename, 0))  # a partial file, if any
                return PrefillReply(status, body, content_type, parsed, n)
            return PrefillReply(status, body, content_type, parsed, SlotHandoff(filename, n))
        finally:
            self.slots(engine.id).release(slot)

    @asynccontextmanager
    async def decode(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        client_body: dict[str, Any],
        handoff: object,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> AsyncIterator[dict[str, Any]]:
        assert isinstance(handoff, SlotHandoff)
        slot = await self._slot(engine, timeout_s, None)  # the restore replaces its KV
        try:
            status, body, _ = await self._post(
                pool,
                f"{engine.url}/slots/{slot}?action=restore",
                {"filename": handoff.filename},
                headers,
                timeout_s,
            )
            if status == 400:
                raise HandoffRefused(f"slot restore refused: {_message(body)}")
            if status != 200:
                cls = classify_status(status) or FailureClass.INFERENCE_STATUS
                raise EngineFailure(cls, f"slot restore answered HTTP {status}", status=status)
            try:
                restored = orjson.loads(body).get("n_restored")
            except (orjson.JSONDecodeError, AttributeError):
                restored = None
            if restored != handoff.n_tokens:
                raise HandoffRefused(
                    f"slot restore read {restored!r} tokens, the prefill saved {handoff.n_tokens}"
                )
            yield decode_body(client_body, slot)
        finally:
            self.slots(engine.id).release(slot)

    def unified_body(self, client_body: dict[str, Any]) -> dict[str, Any]:
        return clean_body(client_body)

    def recomputed(self, final_event: bytes | None) -> str | None:
        return recomputed(final_event)

    async def rendered_chat(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        chat_body: dict[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> str | None:
        """`POST /apply-template`: the prompt llama-server would build for the chat. Given
        back to it as text followed by token ids, it tokenizes to exactly the chat's prompt
        and the delivered tokens."""
        keys = ("messages", "chat_template_kwargs")
        body = {k: chat_body[k] for k in keys if k in chat_body}
        status, answer, _ = await self._post(
            pool, engine.url + "/apply-template", body, headers, timeout_s
        )
        if status != 200:
            cls = classify_status(status, answer) or FailureClass.INFERENCE_STATUS
            raise EngineFailure(cls, f"apply-template answered HTTP {status}", status=status)
        try:
            prompt = orjson.loads(answer).get("prompt")
        except (orjson.JSONDecodeError, AttributeError):
            prompt = None
        if not isinstance(prompt, str):
            raise EngineFailure(FailureClass.INFERENCE_STATUS, "apply-template gave no prompt")
        return prompt

    async def discard(self, producer: EngineConfig, handoff: object) -> None:
        """Remove the slot file, when the router can see the engines' slot directory.

        Shielded: discard runs in `finally` blocks of requests that are often being cancelled
        (the client went away), and a cancelled `to_thread` whose job had not yet started
        would never run it. The unlink itself runs in a thread: the shared slot directory is
        often a network file system."""
        if not isinstance(handoff, SlotHandoff) or producer.slot_save_path is None:
            return
        await asyncio.shield(_unlink(Path(producer.slot_save_path) / handoff.filename))

    def observe_health(self, engine_id: str, answered: bool) -> None:
        """A new generation starts when an engine answers after silence (or for the first time)."""
        if answered and not self._answering.get(engine_id, False):
            previous = self._generations.get(engine_id, 0.0)
            self._generations[engine_id] = max(self._clock.wall(), previous + 1e-6)
            self._sized.discard(engine_id)  # a restarted server may run with another --parallel
        self._answering[engine_id] = answered

    async def learn(self, engine: EngineConfig) -> None:
        """Size the slot pool from `/props` (once per generation), and warn when the
        servers' slot layouts differ, since their slot files then cannot be exchanged."""
        if engine.id in self._sized:
            return
        try:
            reply = await control_get(self._client, engine, "/props", self._timeout_s)
            layout = read_layout(orjson.loads(reply.body))
        except (EngineFailure, orjson.JSONDecodeError):
            return
        if layout is None:
            return
        self.slots(engine.id).resize(layout.slots)
        self._sized.add(engine.id)
        self._layouts[engine.id] = layout
        conflict = layout_conflict(self._layouts)
        if conflict is not None:
            log.warning("%s", conflict)

    async def generation(self, engine: EngineConfig) -> tuple[float | None, str]:
        generation = self._generations.get(engine.id)
        if generation is None:
            return None, "not yet seen answering a health check"
        return generation, "first healthy answer after silence, as seen by this router"
