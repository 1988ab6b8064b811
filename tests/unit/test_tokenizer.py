"""Prompt token ids in the router (DESIGN §11): what each kind of prompt becomes, the cache, the
fallback to pseudo ids, loading from config, and the template sandbox. No network: the
tokenizer here is a small one built with `tokenizers`; real ones are in
test_tokenizer_fidelity.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from narwhal.config import ConfigError, PlacementConfig, parse_config
from narwhal.placement.chat_template import ChatTemplate, ChatTemplateError, select_template
from narwhal.placement.tokenizer import (
    OFF_LOOP_CHARS,
    ModelTokenizer,
    PromptTokenizer,
    PromptTokens,
    plain_chat_text,
    pseudo_token_ids,
)

WORDS = ["[UNK]", "<s>", "<|turn|>", "user", "assistant", "system", "hello", "narwhal", ":"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn|>{{ m.role }} : {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn|>assistant :{% endif %}"
)
CONFIG = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "chat_template": TEMPLATE}


def small_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|turn|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def write_dir(path: Path, config: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    small_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(CONFIG if config is None else config))
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_dir(tmp_path / "small")


def chat(*turns: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


def test_chat_renders_the_template_and_adds_no_special_tokens(model_dir: Path) -> None:
    tok = ModelTokenizer.from_path(model_dir)
    body = chat(("user", "hello narwhal"))
    assert tok.render_chat(body) == "<s><|turn|>user : hello narwhal\n<|turn|>assistant :"
    # bos once (written by the template, matched as a special token), not twice
    assert tok.chat_ids(body) == (1, 2, 3, 8, 6, 7, 2, 4, 8)


def test_completion_gets_the_default_special_tokens(model_dir: Path) -> None:
    assert ModelTokenizer.from_path(model_dir).completion_ids("hello narwhal") == (1, 6, 7)


def test_add_generation_prompt_false_and_text_parts(model_dir: Path) -> None:
    tok = ModelTokenizer.from_path(model_dir)
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "narwhal"}]
    body = chat(("user", parts), add_generation_prompt=False)
    assert tok.render_chat(body) == "<s><|turn|>user : hello\nnarwhal\n"


def test_ids_given_are_used_as_is_and_unknown_models_get_pseudo_ids(model_dir: Path) -> None:
    tokens = PromptTokenizer({"m": ModelTokenizer.from_path(model_dir)})
    given = tokens.completion("m", [5, 4, 3])
    assert (given.ids, given.exact) == ((5, 4, 3), True)
    assert tokens.completion("m", "hello").exact
    other = tokens.completion("other", "hello narwhal")
    assert (other.ids, other.exact) == (pseudo_token_ids("hello narwhal"), False)
    assert tokens.chat("other", chat(("user", "hi"))).ids == pseudo_token_ids("user: hi\n")


def test_a_refused_conversation_is_placed_by_its_text(tmp_path: Path) -> None:
    refusing = "{{ raise_exception('roles must alternate') }}"
    model = ModelTokenizer.from_path(write_dir(tmp_path / "r", {"chat_template": refusing}))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        model.chat_ids(chat(("user", "hi")))
    placed = PromptTokenizer({"m": model}).chat("m", chat(("user", "hi")))
    assert (placed.ids, placed.exact) == (pseudo_token_ids("user: hi\n"), False)


def test_a_bare_tokenizer_json_has_no_template(model_dir: Path) -> None:
    tok = ModelTokenizer.from_path(model_dir / "tokenizer.json")
    assert not tok.has_chat_template
    assert tok.completion_ids("hello") == (1, 6)
    assert not PromptTokenizer({"m": tok}).chat("m", chat(("user", "hello"))).exact


def test_chat_template_jinja_wins_over_the_config(model_dir: Path) -> None:
    (model_dir / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert ModelTokenizer.from_path(model_dir).render_chat(chat(("user", "hello"))) == "hello"


def test_encodings_are_cached_by_text_least_recently_used_out(model_dir: Path) -> None:
    tok = ModelTokenizer.from_path(model_dir, cache_entries=2)
    first = tok.chat_ids(chat(("user", "hello")))
    assert tok.chat_ids(chat(("user", "hello"))) is first
    assert (tok.cache_hits, tok.cache_misses) == (1, 1)
    tok.completion_ids("hello")  # same text as nothing above: a miss
    tok.completion_ids("narwhal")  # evicts the chat encoding (least recently used)
    assert tok.chat_ids(chat(("user", "hello"))) == first
    assert (tok.cache_hits, tok.cache_misses) == (1, 4)


async def test_a_long_prompt_is_encoded_off_the_loop_and_then_found_cached(
    model_dir: Path,
) -> None:
    """`warm` encodes a text of OFF_LOOP_CHARS or more in a thread (the encoder releases the
    GIL only in `encode_batch`) and caches it: the request path's `encode` is then a hit
    with the same ids; a short text is left to `encode`."""
    tok = ModelTokenizer.from_path(model_dir)
    long = "hello narwhal " * (OFF_LOOP_CHARS // 14 + 1)
    await tok.warm(long, add_special_tokens=True)
    assert (tok.cache_hits, tok.cache_misses) == (0, 0)
    ids = tok.completion_ids(long)
    assert (tok.cache_hits, tok.cache_misses) == (1, 0)
    assert ids == tuple(small_tokenizer().encode(long).ids)
    await tok.warm("hello", add_special_tokens=True)
    tok.completion_ids("hello")
    assert tok.cache_misses == 1  # not warmed: encoded on the loop


async def test_a_long_chat_is_rendered_once_and_encoded_off_the_loop(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ModelTokenizer.from_path(model_dir)
    prompts = PromptTokenizer({"m": model})
    body = chat(("user", "hello narwhal " * (OFF_LOOP_CHARS // 14 + 1)))
    renders = []
    render = model.render_chat
    monkeypatch.setattr(model, "render_chat", lambda b: renders.append(1) or render(b))
    tokens = await prompts.chat_async("m", body)
    assert renders == [1]
    # Encoded in the thread and cached there; the request's encode found it.
    assert (model.cache_hits, model.cache_misses) == (1, 0)
    assert tokens == prompts.chat("m", body) and tokens.exact
    long = "hello narwhal " * (OFF_LOOP_CHARS // 14 + 1)
    assert (await prompts.completion_async("m", long)).ids == model.completion_ids(long)
    # A model without a tokenizer: pseudo ids, nothing encoded.
    other = await prompts.completion_async("other", "anything")
    assert other == PromptTokens(pseudo_token_ids("anything"), exact=False)


def test_pseudo_ids_are_four_bytes_each_and_keep_prefixes() -> None:
    assert pseudo_token_ids("abcd") == (0x64636261,)
    assert pseudo_token_ids("abcde") == (0x64636261, 0x65)  # the tail zero-padded
    assert pseudo_token_ids("") == ()
    long = "The narwhal 🦄 " * 50
    ids = pseudo_token_ids(long)
    assert len(ids) == -(-len(long.encode()) // 4)
    assert all(0 <= i < 2**32 for i in ids)
    assert pseudo_token_ids(long + "more")[: len(ids) - 1] == ids[:-1]


def test_a_longer_conversation_extends_the_plain_text() -> None:
    short = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    longer = [*short, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    assert plain_chat_text(longer).startswith(plain_chat_text(short))


def test_the_template_runs_sandboxed() -> None:
    escape = ChatTemplate("{{ ''.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        escape.render([])
    underscore = ChatTemplate("{% set ns = namespace(_x=1) %}", {})
    with pytest.raises(ChatTemplateError):
        underscore.render([])


def test_template_helpers() -> None:
    source = (
        "{% generation %}{{ messages[0].content | tojson }}{% endgeneration %}"
        "{% if enable_thinking is defined %}|{{ enable_thinking }}{% endif %}"
        "|{{ messages[0].reasoning_content }}|{{ strftime_now('%Y')|length }}"
    )
    template = ChatTemplate(source, {})
    message = {"role": "user", "content": "ü <b>", "reasoning": "r", "name": None}
    rendered = template.render([message], template_kwargs={"enable_thinking": False})
    assert rendered == '"ü <b>"|False|r|4'  # not ASCII- or HTML-escaped; None values dropped


def test_named_templates_pick_tool_use_with_tools() -> None:
    named = [{"name": "default", "template": "d"}, {"name": "tool_use", "template": "t"}]
    assert select_template(named, tools=False) == "d"
    assert select_template(named, tools=True) == "t"
    with pytest.raises(ChatTemplateError):
        select_template([{"name": "tool_use", "template": "t"}], tools=False)


BASE = {"model": "m", "engines": [{"id": "a", "url": "http://127.0.0.1:9", "role": "both"}]}


def test_config_refuses_a_missing_tokenizer_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "placement": {"tokenizers": {"org/m-1.5": str(tmp_path / "no")}}})
    assert info.value.problems == [
        f"placement.tokenizers.org/m-1.5: '{tmp_path / 'no'}' does not exist"
    ]
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "placement": {"tokenizers": {"m": str(tmp_path)}}})
    assert info.value.problems[0].startswith("placement.tokenizers.m: ")
    assert "without tokenizer.json" in info.value.problems[0]


def test_config_loads_tokenizers_and_names_one_that_cannot_load(
    model_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    cfg = parse_config({**BASE, "placement": {"tokenizers": {"m": str(model_dir)}}})
    tokens = PromptTokenizer.from_config(cfg.placement)
    assert tokens.completion("m", "hello").ids == (1, 6)
    with pytest.raises(ConfigError) as info:
        PromptTokenizer.from_config(PlacementConfig(tokenizers={"bad": str(broken)}))
    assert info.value.problems[0].startswith("placement.tokenizers.bad: cannot load")
