"""The official openai client through Narwhal: PD output equals a unified engine's output.

A prefill sim, a decode sim and a unified sim run as real processes for the whole module;
each test gets a fresh router over the PD pair and compares with the unified sim directly.
Generated text is a function of the KV the decode engine used, and `cached_tokens` counts the
prompt tokens it loaded from the prefill engine, so equal text plus `cached_tokens ==
prompt_tokens` shows the handoff was used.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"
PROMPT = "narwhals hand over their kv cache between prefill and decode engines"
MESSAGES = [
    {"role": "system", "content": "answer in made up words"},
    {"role": "user", "content": "what does a narwhal router do"},
]


@dataclass
class Sims:
    prefill: SimProcess
    decode: SimProcess
    unified: SimProcess


@pytest.fixture(scope="module")
def sims() -> Iterator[Sims]:
    factory = SimFactory()
    try:
        prefill, decode, unified = factory.start_many(
            [["--role", "prefill", "--kv-role", "kv_producer", "--itl-ms", "0"],
             ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "0"],
             ["--role", "both", "--itl-ms", "0"]]
        )  # fmt: skip
        yield Sims(prefill, decode, unified)
    finally:
        factory.close()


@pytest.fixture
async def rr(sims: Sims, start_router: StartRouter) -> RunningRouter:
    for sim in (sims.prefill, sims.decode, sims.unified):
        sim.clear_faults()
        sim.clear_requests()
    return await start_router(
        [{"id": "p0", "url": sims.prefill.url, "role": "prefill"},
         {"id": "d0", "url": sims.decode.url, "role": "decode"}]
    )  # fmt: skip


@pytest.fixture
async def clients(rr: RunningRouter, sims: Sims) -> AsyncIterator[tuple[Any, Any]]:
    via = openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="client-key", max_retries=0)
    ref = openai.AsyncOpenAI(base_url=sims.unified.url + "/v1", api_key="x", max_retries=0)
    yield via, ref
    await via.close()
    await ref.close()


async def _run(client: Any, endpoint: str, stream: bool, usage: bool, **extra: Any) -> dict:
    """One request; returns text, finish reason, usage (dict or None) and the chunk count."""
    args: dict[str, Any] = {"model": MODEL, **extra}
    if stream:
        args["stream"] = True
        if usage:
            args["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        args.setdefault("messages", MESSAGES)
        result = await client.chat.completions.create(**args)
    else:
        args.setdefault("prompt", PROMPT)
        result = await client.completions.create(**args)
    if not stream:
        choice = result.choices[0]
        text = choice.message.content if endpoint == "chat" else choice.text
        return {
            "text": text,
            "finish": choice.finish_reason,
            "usage": result.usage.model_dump() if result.usage else None,
            "chunks": 1,
        }
    parts, finish, use, chunks = [], None, None, 0
    async for chunk in result:
        chunks += 1
        if chunk.usage is not None:
            use = chunk.usage.model_dump()
        for choice in chunk.choices:
            parts.append((choice.delta.content if endpoint == "chat" else choice.text) or "")
            finish = choice.finish_reason or finish
    return {"text": "".join(parts), "finish": finish, "usage": use, "chunks": chunks}


CASES = [
    pytest.param("completions", False, False, id="completions"),
    pytest.param("completions", True, False, id="completions-stream"),
    pytest.param("completions", True, True, id="completions-stream-usage"),
    pytest.param("chat", False, False, id="chat"),
    pytest.param("chat", True, False, id="chat-stream"),
    pytest.param("chat", True, True, id="chat-stream-usage"),
]


@pytest.mark.parametrize(("endpoint", "stream", "usage"), CASES)
async def test_output_equals_unified_run(
    clients: tuple[Any, Any], sims: Sims, endpoint: str, stream: bool, usage: bool
) -> None:
    via_client, ref_client = clients
    tokens = {"max_completion_tokens": 9} if endpoint == "chat" else {"max_tokens": 9}
    via = await _run(via_client, endpoint, stream, usage, **tokens)
    ref = await _run(ref_client, endpoint, stream, usage, **tokens)

    assert via["text"] == ref["text"]
    assert len(via["text"].split()) == 9
    assert via["finish"] == ref["finish"] == "length"
    if stream:
        assert via["chunks"] == ref["chunks"]  # forwarded event for event
    if not stream or usage:
        assert via["usage"] is not None and ref["usage"] is not None
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert via["usage"][key] == ref["usage"][key]
        # The decode engine loaded the whole prompt from the prefill engine's KV.
        assert (
            via["usage"]["prompt_tokens_details"]["cached_tokens"] == via["usage"]["prompt_tokens"]
        )
        assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    else:
        assert via["usage"] is None

    legs = [r["leg"] for r in sims.prefill.requests()], [r["leg"] for r in sims.decode.requests()]
    assert legs == (["prefill"], ["decode"])
    assert sims.decode.metric("narwhal_sim_kv_blocks_received_total") > 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    "extra",
    [{"max_tokens": 1}, {"prompt": [101, 202, 303, 404, 505], "max_tokens": 4}, {}],
    ids=["one-token", "token-ids", "default-max-tokens"],
)
async def test_completion_variants_equal_unified_run(
    clients: tuple[Any, Any], sims: Sims, extra: dict[str, Any], stream: bool
) -> None:
    via_client, ref_client = clients
    via = await _run(via_client, "completions", stream, True, **extra)
    ref = await _run(ref_client, "completions", stream, True, **extra)
    assert via["text"] == ref["text"] and via["text"]
    assert via["finish"] == ref["finish"] == "length"
    assert via["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    assert via["usage"]["prompt_tokens_details"]["cached_tokens"] == via["usage"]["prompt_tokens"]


async def test_models_lists_the_served_model(clients: tuple[Any, Any]) -> None:
    via, _ = clients
    models = await via.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def _first_word(ref_client: Any, endpoint: str) -> str:
    limit = {"max_completion_tokens": 1} if endpoint == "chat" else {"max_tokens": 1}
    one = await _run(ref_client, endpoint, False, False, **limit)
    word = one["text"].strip()
    assert word
    return word


@pytest.mark.parametrize(("endpoint", "stream", "usage"), CASES)
async def test_stop_string_on_the_prefill_token_is_a_complete_answer(
    clients: tuple[Any, Any], sims: Sims, endpoint: str, stream: bool, usage: bool
) -> None:
    """vLLM's prefill ends the request (finish_reason stop, kv_transfer_params null): no decode."""
    via_client, ref_client = clients
    stop = await _first_word(ref_client, endpoint)
    sims.unified.clear_requests()
    tokens = {"max_completion_tokens": 6} if endpoint == "chat" else {"max_tokens": 6}
    via = await _run(via_client, endpoint, stream, usage, stop=[stop], **tokens)
    ref = await _run(ref_client, endpoint, stream, usage, stop=[stop], **tokens)

    assert via["text"] == ref["text"] == ""
    assert via["finish"] == ref["finish"] == "stop"
    assert via["usage"] == ref["usage"]
    if stream and not usage:
        assert via["usage"] is None
    prefill_legs = [r["leg"] for r in sims.prefill.requests()]
    assert prefill_legs == ["prefill"]
    assert sims.decode.requests() == []


async def test_stop_string_later_in_the_answer_goes_through_decode(
    clients: tuple[Any, Any], sims: Sims
) -> None:
    via_client, ref_client = clients
    full = await _run(ref_client, "completions", False, False, max_tokens=6)
    third = full["text"].split()[2]
    if third in full["text"].split()[:2]:
        pytest.skip("the third word repeats an earlier one")
    via = await _run(via_client, "completions", True, False, max_tokens=6, stop=[third])
    assert via["text"] == "".join(" " + w for w in full["text"].split()[:2])
    assert via["finish"] == "stop"
    assert [r["leg"] for r in sims.decode.requests()] == ["decode"]
