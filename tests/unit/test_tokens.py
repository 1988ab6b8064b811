"""Prompt-length checks (DESIGN §1, "Token counting"): count only near the limit, cache counts."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.dataplane.requests import BadRequest, ClientRequest, Endpoint, parse_request
from narwhal.dataplane.tokens import (
    PER_MESSAGE_MARGIN_TOKENS,
    TEMPLATE_MARGIN_TOKENS,
    TokenBudget,
    TokenCheck,
    Verdict,
)

MODEL = "demo-model"


class FakeCounter:
    """An async token counter that records every call and answers from a script."""

    def __init__(self, answer: int | dict[str, int | None] | None = None) -> None:
        self.calls: list[ClientRequest] = []
        self._answer = answer

    async def __call__(self, req: ClientRequest) -> int | None:
        self.calls.append(req)
        if isinstance(self._answer, dict):
            assert req.prompt_text is not None
            return self._answer[req.prompt_text]
        return self._answer


def _req(
    text: str | None = "hello",
    *,
    max_tokens: int | None = None,
    endpoint: Endpoint = "completions",
    token_count: int | None = None,
    messages: int = 0,
) -> ClientRequest:
    return ClientRequest(
        endpoint=endpoint,
        body={},
        stream=False,
        include_usage=False,
        max_tokens=max_tokens,
        prompt_text=None if token_count is not None else text,
        prompt_token_count=token_count,
        message_count=messages,
    )


def _bound(text: str, messages: int = 0) -> int:
    return len(text.encode()) + TEMPLATE_MARGIN_TOKENS + PER_MESSAGE_MARGIN_TOKENS * messages


# --------------------------------------------------------------------------- no counting


async def test_unknown_limit_allows_without_counting() -> None:
    counter = FakeCounter(10**9)
    result = await TokenBudget(8).check(_req("x" * 100_000, max_tokens=10**6), None, counter)
    assert result == TokenCheck(Verdict.UNKNOWN_LIMIT, None)
    assert counter.calls == []


async def test_short_prompt_fits_by_bound_without_counting() -> None:
    counter = FakeCounter(5)
    result = await TokenBudget(8).check(_req("hello", max_tokens=100), 4096, counter)
    assert result == TokenCheck(Verdict.FITS_BY_BOUND, None)
    assert counter.calls == []


@pytest.mark.parametrize(
    ("endpoint", "messages"), [("completions", 0), ("chat", 3)], ids=["completions", "chat"]
)
async def test_bound_exactly_at_limit_needs_no_count(endpoint: Endpoint, messages: int) -> None:
    text = "é" * 50  # 100 bytes: the bound is in bytes, not characters
    limit = _bound(text, messages) + 7
    counter = FakeCounter(1)
    budget = TokenBudget(8)
    req = _req(text, max_tokens=7, endpoint=endpoint, messages=messages)
    assert (await budget.check(req, limit, counter)).verdict is Verdict.FITS_BY_BOUND
    assert counter.calls == []
    # one token less of room and the bound no longer proves it fits: count it
    assert (await budget.check(req, limit - 1, counter)).verdict is Verdict.COUNTED
    assert len(counter.calls) == 1


@pytest.mark.parametrize(
    ("count", "max_tokens", "limit"),
    [(10, 5, 100), (95, 5, 100), (100, None, 1000)],
    ids=["small", "exactly-full", "no-max-tokens"],
)
async def test_token_ids_are_exact_and_never_counted(
    count: int, max_tokens: int | None, limit: int
) -> None:
    counter = FakeCounter(10**9)
    result = await TokenBudget(8).check(
        _req(token_count=count, max_tokens=max_tokens), limit, counter
    )
    assert result == TokenCheck(Verdict.EXACT, count)
    assert counter.calls == []


@pytest.mark.parametrize(
    ("count", "max_tokens", "param"),
    [(96, 5, "max_tokens"), (101, None, "prompt"), (5000, 1, "max_tokens")],
    ids=["one-over-with-max-tokens", "prompt-alone-over", "far-over"],
)
async def test_token_ids_over_length_are_rejected(
    count: int, max_tokens: int | None, param: str
) -> None:
    counter = FakeCounter(0)
    with pytest.raises(BadRequest) as info:
        await TokenBudget(8).check(_req(token_count=count, max_tokens=max_tokens), 100, counter)
    assert info.value.status == 400
    assert info.value.param == param
    assert "maximum context length is 100 tokens" in info.value.message
    assert counter.calls == []


# --------------------------------------------------------------------------- near the limit


async def test_near_limit_is_counted() -> None:
    text = "word " * 200  # 1000 bytes
    counter = FakeCounter(250)
    req = _req(text, max_tokens=100)
    result = await TokenBudget(8).check(req, 1024, counter)
    assert result == TokenCheck(Verdict.COUNTED, 250)
    assert counter.calls == [req]


async def test_counted_over_length_is_rejected() -> None:
    counter = FakeCounter(1000)
    with pytest.raises(BadRequest) as info:
        await TokenBudget(8).check(_req("w" * 1200, max_tokens=30), 1024, counter)
    assert info.value.status == 400
    assert info.value.param == "max_tokens"
    assert "requested 1030 tokens (1000 in the messages, 30 in the completion)" in (
        info.value.message
    )
    assert len(counter.calls) == 1


async def test_counted_exactly_full_is_allowed() -> None:
    counter = FakeCounter(994)
    result = await TokenBudget(8).check(_req("w" * 1200, max_tokens=30), 1024, counter)
    assert result == TokenCheck(Verdict.COUNTED, 994)


@pytest.mark.parametrize("cache_size", [0, 8], ids=["no-cache", "cache"])
async def test_count_failure_allows_and_is_not_cached(cache_size: int) -> None:
    counter = FakeCounter(None)
    budget = TokenBudget(cache_size)
    req = _req("w" * 5000, max_tokens=10)
    for attempt in (1, 2):
        assert await budget.check(req, 1024, counter) == TokenCheck(Verdict.COUNT_FAILED, None)
        assert len(counter.calls) == attempt


# --------------------------------------------------------------------------- the cache


async def test_cache_hit_avoids_a_second_call() -> None:
    counter = FakeCounter(300)
    budget = TokenBudget(8)
    text = "w" * 1500
    first = await budget.check(_req(text, max_tokens=10), 1024, counter)
    second = await budget.check(_req(text, max_tokens=500), 1024, counter)
    assert first == TokenCheck(Verdict.COUNTED, 300)
    assert second == TokenCheck(Verdict.CACHED, 300)
    assert len(counter.calls) == 1


async def test_cache_hit_still_enforces_the_limit() -> None:
    counter = FakeCounter(1000)
    budget = TokenBudget(8)
    text = "w" * 1500
    assert (await budget.check(_req(text, max_tokens=10), 1024, counter)).verdict is Verdict.COUNTED
    with pytest.raises(BadRequest) as info:
        await budget.check(_req(text, max_tokens=100), 1024, counter)
    assert info.value.status == 400
    assert len(counter.calls) == 1


async def test_over_length_count_is_cached_too() -> None:
    counter = FakeCounter(5000)
    budget = TokenBudget(8)
    for _ in range(3):
        with pytest.raises(BadRequest):
            await budget.check(_req("w" * 6000), 1024, counter)
    assert len(counter.calls) == 1


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (_req("w" * 1500), _req("w" * 1499 + "x")),
        (_req("w" * 1500), _req("w" * 1500, endpoint="chat", messages=0)),
        (
            _req("w" * 1500, endpoint="chat", messages=1),
            _req("w" * 1500, endpoint="chat", messages=2),
        ),
    ],
    ids=["different-text", "different-endpoint", "different-message-count"],
)
async def test_cache_key_separates_prompts(a: ClientRequest, b: ClientRequest) -> None:
    counter = FakeCounter(300)
    budget = TokenBudget(8)
    await budget.check(a, 1024, counter)
    assert (await budget.check(b, 1024, counter)).verdict is Verdict.COUNTED
    assert len(counter.calls) == 2


async def test_cache_size_zero_never_caches() -> None:
    counter = FakeCounter(300)
    budget = TokenBudget(0)
    for _ in range(3):
        assert (await budget.check(_req("w" * 1500), 1024, counter)).verdict is Verdict.COUNTED
    assert len(counter.calls) == 3


async def test_cache_evicts_least_recently_used() -> None:
    texts = {name: name * 1500 for name in "abc"}
    counter = FakeCounter({t: 300 for t in texts.values()})
    budget = TokenBudget(2)

    async def check(name: str) -> Verdict:
        return (await budget.check(_req(texts[name]), 1024, counter)).verdict

    assert await check("a") is Verdict.COUNTED
    assert await check("b") is Verdict.COUNTED
    assert await check("a") is Verdict.CACHED  # a is now the most recent
    assert await check("c") is Verdict.COUNTED  # evicts b
    assert await check("a") is Verdict.CACHED
    assert await check("b") is Verdict.COUNTED  # evicts c
    assert await check("a") is Verdict.CACHED
    called = [r.prompt_text[0] for r in counter.calls if r.prompt_text]
    assert called == ["a", "b", "c", "b"]


# --------------------------------------------------------------------------- with parse_request


async def test_parsed_token_id_prompt_is_exact() -> None:
    req = parse_request(
        "completions", orjson.dumps({"prompt": list(range(90)), "max_tokens": 11}), MODEL
    )
    counter = FakeCounter(0)
    with pytest.raises(BadRequest):
        await TokenBudget(8).check(req, 100, counter)
    assert counter.calls == []


async def test_parsed_chat_uses_max_completion_tokens() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4000}
    req = parse_request("chat", orjson.dumps(body), MODEL)
    counter = FakeCounter(20)
    with pytest.raises(BadRequest) as info:
        await TokenBudget(8).check(req, 4000, counter)
    assert info.value.param == "max_tokens"
    assert len(counter.calls) == 1


# --------------------------------------------------------------------------- regressions
# Each of these was a bug found by this suite (see the report), since fixed in src.


@pytest.mark.parametrize("how", ["token-ids", "counted"])
async def test_prompt_filling_the_whole_context_is_rejected(how: str) -> None:
    """The prefill leg always asks for one token: a prompt of max_model_len tokens cannot fit."""
    counter = FakeCounter(1024)
    req = _req(token_count=1024) if how == "token-ids" else _req("w" * 2000)
    with pytest.raises(BadRequest) as info:
        await TokenBudget(8).check(req, 1024, counter)
    assert info.value.status == 400
    assert info.value.param == "prompt"


async def test_prompt_one_short_of_the_context_is_allowed() -> None:
    counter = FakeCounter(0)
    result = await TokenBudget(8).check(_req(token_count=1023), 1024, counter)
    assert result == TokenCheck(Verdict.EXACT, 1023)


_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "d" * 2000,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    for i in range(10)
]


async def test_chat_tools_are_part_of_the_bound() -> None:
    """Chat templates render `tools` into the prompt: they cannot be left out of the bound."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": _TOOLS, "max_tokens": 16}
    req = parse_request("chat", orjson.dumps(body), MODEL)
    counter = FakeCounter(6000)
    with pytest.raises(BadRequest):
        await TokenBudget(8).check(req, 4096, counter)
    assert len(counter.calls) == 1


async def test_assistant_tool_calls_are_part_of_the_bound() -> None:
    """An assistant turn with `content: null` still renders its tool calls' arguments."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": orjson.dumps({"text": "x" * 20_000}).decode()},
    }
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    req = parse_request("chat", orjson.dumps({"messages": messages, "max_tokens": 16}), MODEL)
    counter = FakeCounter(6000)
    with pytest.raises(BadRequest):
        await TokenBudget(8).check(req, 4096, counter)
    assert len(counter.calls) == 1
