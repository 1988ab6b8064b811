"""The official openai client against a unified sim: what a vLLM client sees, it sees."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.sim_process import SimProcess

PROMPT = "the quick brown fox jumps over the lazy dog"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "you are terse"},
    {"role": "user", "content": "name a colour"},
]


@pytest.fixture
def client(unified: SimProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=unified.url + "/v1", api_key="x", max_retries=0)


def test_completions_stream_and_not_agree(client: openai.OpenAI) -> None:
    full = client.completions.create(model="demo-model", prompt=PROMPT, max_tokens=10)
    assert full.object == "text_completion"
    assert full.model == "demo-model"
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.text.split()) == 10
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (9, 10)
    assert full.usage.total_tokens == 19

    stream = client.completions.create(
        model="demo-model",
        prompt=PROMPT,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_stream_and_not_agree(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model="demo-model",
        messages=MESSAGES,
        max_completion_tokens=6,
        temperature=0.7,
        seed=3,
    )
    assert full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant"
    assert message.content is not None
    assert len(message.content.split()) == 6
    assert full.usage is not None
    assert full.usage.prompt_tokens == 3 + 3 + 2 + 1  # words, one role token each, generation

    stream = client.chat.completions.create(
        model="demo-model",
        messages=MESSAGES,
        max_completion_tokens=6,
        stream=True,
    )
    chunks = list(stream)
    first = chunks[0].choices[0].delta
    assert (first.role, first.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_strings_end_generation_without_the_stop_word(client: openai.OpenAI) -> None:
    words = client.completions.create(model="demo-model", prompt=PROMPT, max_tokens=8)
    fourth = words.choices[0].text.split()[3]
    cut = words.choices[0].text.split().index(fourth)
    stopped = client.completions.create(
        model="demo-model", prompt=PROMPT, max_tokens=8, stop=["zzz", fourth]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text.split() == words.choices[0].text.split()[:cut]
    stream = client.completions.create(
        model="demo-model", prompt=PROMPT, max_tokens=8, stop=fourth, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == stopped.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_and_unknown_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo-model"]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="other", prompt=PROMPT, max_tokens=1)
    assert err.value.status_code == 404
