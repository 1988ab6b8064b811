"""Migration on real `llama-server` processes (issue 18): the decode server is killed
(SIGKILL) while it streams, and the stream completes on the other decode server.

llama.cpp's OpenAI answers carry no token ids, so Narwhal asks each leg for one top logprob,
whose entries carry the ids; the continuation's prompt is the original prompt followed by the
delivered ids (a chat's as `/apply-template` renders it). At temperature 0 the migrated text
must equal an uninterrupted run's, token for token, and the usage must count the prompt and
every completion token once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e.test_llamacpp import SECTIONS, engine
from tests.support.http import metric
from tests.support.llama import LlamaBinaries, LlamaServer
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter

pytestmark = [pytest.mark.llama, pytest.mark.slow]

TOKENS = 40
KILL_AT = 6  # chunks with text the client has when the decode server is killed


@pytest.fixture(scope="module")
def servers(bins: LlamaBinaries, slot_dir: Path) -> Iterator[dict[str, LlamaServer]]:
    """One prefill and two decode servers sharing `slot_dir`."""
    started: dict[str, LlamaServer] = {}
    try:
        for name in ("p1", "d1", "d2"):
            started[name] = LlamaServer(bins, slot_dir).start()
        yield started
    finally:
        for server in started.values():
            server.stop()


async def _router(
    start_router: StartRouter, servers: dict[str, LlamaServer], slot_dir: Path
) -> RunningRouter:
    for server in servers.values():  # a server killed by an earlier test comes back
        if not server.running:
            server.start()
    roles = {"p1": "prefill", "d1": "decode", "d2": "decode"}
    rr = await start_router(
        [engine(name, servers[name], role, slot_dir) for name, role in roles.items()],
        **{**SECTIONS, "serving": {**SECTIONS["serving"], "policy": "bounded"}},
    )
    await eventually(lambda: rr.router.ready() is None, timeout_s=10, what="router ready")
    return rr


async def _stream(
    rr: RunningRouter, endpoint: str, servers: dict[str, LlamaServer], kill: bool
) -> tuple[str, Any, set[str], str | None]:
    """One streamed request at temperature 0; with `kill`, the decode server serving it is
    killed once the client has `KILL_AT` chunks. Returns text, usage, ids, finish reason."""
    text, usage, ids, finish = "", None, set(), None
    chunks = 0
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0) as client:
        args: dict[str, Any] = {
            "model": "demo-model",
            "max_tokens": TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if endpoint == "chat":
            messages: Any = [{"role": "user", "content": "Tell me a story about a fox."}]
            stream: Any = await client.chat.completions.create(messages=messages, **args)
        else:
            prompt = "Once upon a time in a land far away there lived a"
            stream = await client.completions.create(prompt=prompt, **args)
        async for chunk in stream:
            ids.add(chunk.id)
            usage = chunk.usage or usage
            for choice in chunk.choices:
                piece = choice.delta.content if endpoint == "chat" else choice.text
                finish = choice.finish_reason or finish
                if piece:
                    text += piece
                    chunks += 1
                    if kill and chunks == KILL_AT:
                        fleet = rr.router.fleet
                        serving = [d for d in ("d1", "d2") if fleet.in_flight.of(d)]
                        assert len(serving) == 1, serving
                        servers[serving[0]].kill()
    return text, usage, ids, finish


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_killed_decode_llama_server_is_continued_exactly(
    endpoint: str,
    start_router: StartRouter,
    servers: dict[str, LlamaServer],
    slot_dir: Path,
    http: aiohttp.ClientSession,
) -> None:
    rr = await _router(start_router, servers, slot_dir)
    reference, ref_usage, _, ref_finish = await _stream(rr, endpoint, servers, kill=False)
    assert ref_finish == "length" and ref_usage.completion_tokens == TOKENS, reference

    text, usage, ids, finish = await _stream(rr, endpoint, servers, kill=True)
    assert text == reference
    assert finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        ref_usage.prompt_tokens,
        TOKENS,
        ref_usage.prompt_tokens + TOKENS,
    )
    assert len(ids) == 1
    labels = {"cause": "connection_lost", "kind": "token_ids"}
    assert await metric(http, rr.url, "narwhal_migrations_total", **labels) == 1
    assert await metric(http, rr.url, "narwhal_migrated_streams_total", result="saved") == 1
