"""The router's prompt ids for the demo model (Gemma 3 270M) equal a real llama-server's.

The tokenizer is the one the model's GGUF embeds, converted to tokenizer.json by transformers
(tests/support/tokenizers.py); the chat template is Gemma's turn format, given to llama-server
too (`--jinja --chat-template-file`). llama-server renders with its own Jinja engine and encodes
with its own vocabulary code, so equal text and ids here are two independent implementations
agreeing: `/apply-template` against `render_chat`, then `/tokenize` against the ids.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.placement.tokenizer import ModelTokenizer
from tests.support.llama import LlamaBinaries, LlamaServer
from tests.support.tokenizers import DATA, GEMMA_TEMPLATE, gguf_tokenizer

pytestmark = [pytest.mark.llama, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(bins: LlamaBinaries, slot_dir: Path) -> Iterator[LlamaServer]:
    template = DATA / GEMMA_TEMPLATE
    server = LlamaServer(
        bins, slot_dir, parallel=1, extra_args=("--jinja", "--chat-template-file", str(template))
    )
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gemma(bins: LlamaBinaries) -> ModelTokenizer:
    return ModelTokenizer.from_path(gguf_tokenizer(bins.model))


def post(server: LlamaServer, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.load(resp)


def engine_ids(server: LlamaServer, text: str, *, add_special: bool) -> list[int]:
    body = {"content": text, "add_special": add_special, "parse_special": True}
    return list(post(server, "/tokenize", body)["tokens"])


TEXT = st.lists(
    st.one_of(
        st.text(max_size=24),
        st.sampled_from(["<start_of_turn>", "<end_of_turn>", "<bos>", "\n", "  ", "é", "🦄"]),
    ),
    max_size=5,
).map("".join)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, str]]:
    """Gemma's template takes user and assistant turns, alternating, ending with the user."""
    messages = []
    for turn in range(draw(st.integers(1, 4))):
        if turn:
            messages.append({"role": "assistant", "content": draw(TEXT)})
        messages.append({"role": "user", "content": draw(TEXT)})
    return messages


ENGINE = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_a_plain_chat_matches_the_engine(engine: LlamaServer, gemma: ModelTokenizer) -> None:
    messages = [
        {"role": "user", "content": "Hello narwhal"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Wie geht's? 🦄"},
    ]
    prompt = post(engine, "/apply-template", {"messages": messages})["prompt"]
    assert prompt == gemma.render_chat({"messages": messages})
    assert prompt.startswith("<bos><start_of_turn>user\n")
    ids = engine_ids(engine, prompt, add_special=False)
    assert list(gemma.chat_ids({"messages": messages})) == ids
    assert ids[0] == 2  # <bos>, once: written by the template, parsed as special


@ENGINE
@given(messages=conversations())
def test_chat_ids_equal_the_engines(
    engine: LlamaServer, gemma: ModelTokenizer, messages: list[dict[str, str]]
) -> None:
    prompt = post(engine, "/apply-template", {"messages": messages})["prompt"]
    assert gemma.render_chat({"messages": messages}) == prompt
    assert list(gemma.chat_ids({"messages": messages})) == engine_ids(
        engine, prompt, add_special=False
    )


@ENGINE
@given(prompt=TEXT)
def test_completion_ids_equal_the_engines(
    engine: LlamaServer, gemma: ModelTokenizer, prompt: str
) -> None:
    assert list(gemma.completion_ids(prompt)) == engine_ids(engine, prompt, add_special=True)


def test_the_converted_tokenizer_matches_transformers(gemma: ModelTokenizer, bins: Any) -> None:
    """The demo model's tokenizer.json against transformers' own apply_chat_template."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf_tokenizer(bins.model)))
    messages = [{"role": "user", "content": "Hello narwhal"}]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert list(gemma.chat_ids({"messages": messages})) == list(expected)
