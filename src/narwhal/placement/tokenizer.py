"""A prompt's token ids in the router, before placement and without a round trip to an engine.

Block keys (`placement.keys`) hash token ids, so the router needs the ids the engine will see:
- a prompt given as token ids is used as is;
- a completions prompt given as text is encoded with the model's tokenizer (`tokenizers`, from
  `placement.tokenizers`) and its default special tokens, as vLLM encodes it;
- a chat request is rendered with the model's chat template (`chat_template`, as transformers
  renders it, generation prompt added) and the text encoded without adding special tokens: the
  template wrote them, and special tokens in the rendered text are matched as such;
- a model without a tokenizer gets pseudo token ids over its text (`pseudo_token_ids`): the same
  key machinery then indexes text blocks, an approximate index only (docs/placement.md).

Encodings are cached per model, keyed on the text (a retry, a migrated continuation and
`/admin/placement` re-place the same prompt), least recently used out first.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import tokenizers  # type: ignore[import-untyped, unused-ignore]  # typed from 0.23

from narwhal.config import ConfigError, PlacementConfig
from narwhal.placement.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate, select_template

log = logging.getLogger("narwhal.placement.tokenizer")

TokenIds = tuple[int, ...]
PSEUDO_TOKEN_BYTES = 4  # UTF-8 bytes per pseudo token: about one token of English text


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A prompt's token ids; `exact` is False for pseudo ids (no tokenizer, or none usable)."""

    ids: TokenIds
    exact: bool


class TokenizerLoadError(Exception):
    """A tokenizer or its config that cannot be read."""


def pseudo_token_ids(text: str) -> TokenIds:
    """Pseudo token ids over text: each 4 UTF-8 bytes read as one little-endian uint32 (the tail
    zero-padded). Prompts sharing a text prefix share an id prefix, so the block keys of a model
    without a tokenizer still find shared prefixes; the ids are not the engine's, so the engine's
    KV events can never confirm them. Costs one C call; ids are in [0, 2**32), as keys need."""
    data = text.encode("utf-8", "surrogatepass")
    tail = len(data) % PSEUDO_TOKEN_BYTES
    if tail:
        data += b"\0" * (PSEUDO_TOKEN_BYTES - tail)
    ids = array.array("I")
    ids.frombytes(data)
    if sys.byteorder == "big":
        ids.byteswap()
    return tuple(ids)


def _text_of(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined by newlines (as vLLM
    joins them for templates that take string content); other parts contribute nothing."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        ]
        return "\n".join(texts)
    return ""


def plain_chat_text(messages: Sequence[Any]) -> str:
    """A conversation as plain text for pseudo ids: one `role: content` line per message, so a
    conversation extended by more turns keeps its earlier text as a prefix."""
    lines = []
    for message in messages:
        if isinstance(message, Mapping):
            lines.append(f"{message.get('role', '')}: {_text_of(message.get('content'))}\n")
    return "".join(lines)


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The body's messages with text-part lists joined (vLLM's string content format)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError("messages must be a list of objects")
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" for p in content
        ):
            message = {**message, "content": _text_of(content)}
        out.append(dict(message))
    return out


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken's `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


# Texts at least this long are encoded off the event loop (`ModelTokenizer.warm`): about 4,000
# tokens, a few milliseconds to encode. Measured with Llama 3.2's tokenizer: 35,000 tokens took
# about 100 ms, during which a worker's every other request would wait.
OFF_LOOP_CHARS = 16_384


class ModelTokenizer:
    """One model's tokenizer and chat template, with an LRU cache of encodings by text."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | list[dict[str, str]] | None,
        special_tokens: Mapping[str, str],
        *,
        cache_entries: int = 256,
    ) -> None:
        self._tokenizer = tokenizer
        self._template_source = chat_template
        self._special = dict(special_tokens)
        self._templates: dict[str, ChatTemplate] = {}
        self._cache: OrderedDict[tuple[str, bool], TokenIds] = OrderedDict()
        self._cache_entries = cache_entries
        self.cache_hits = 0
        self.cache_misses = 0

    @classmethod
    def from_path(cls, path: str | Path, *, cache_entries: int = 256) -> ModelTokenizer:
        """A `tokenizer.json`, or a directory with `tokenizer.json`, `tokenizer_config.json`
        (special tokens, `chat_template`) and optionally `chat_template.jinja` (which wins)."""
        path = Path(path)
        directory = path if path.is_dir() else None
        tokenizer_file = path / "tokenizer.json" if directory else path
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the library raises its own untyped errors
            raise TokenizerLoadError(f"cannot load {tokenizer_file}: {exc}") from None
        config: dict[str, Any] = {}
        template: str | list[dict[str, str]] | None = None
        if directory is not None:
            config_file = directory / "tokenizer_config.json"
            try:
                if config_file.is_file():
                    config = json.loads(config_file.read_text(encoding="utf-8"))
                jinja_file = directory / "chat_template.jinja"
                if jinja_file.is_file():
                    template = jinja_file.read_text(encoding="utf-8")
            except (OSError, ValueError) as exc:
                raise TokenizerLoadError(f"cannot read {directory}: {exc}") from None
            if not isinstance(config, dict):
                raise TokenizerLoadError(f"{config_file} is not a JSON object")
        if template is None:
            template = config.get("chat_template")
        special = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_content(config.get(name))) is not None
        }
        return cls(tokenizer, template, special, cache_entries=cache_entries)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._template_source)

    def _template(self, tools: bool) -> ChatTemplate:
        if not self._template_source:
            raise ValueError("the tokenizer has no chat template")
        source = select_template(self._template_source, tools=tools)
        compiled = self._templates.get(source)
        if compiled is None:
            compiled = self._templates[source] = ChatTemplate(source, self._special)
        return compiled

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """A chat request's prompt text: its messages, `tools`, `documents`,
        `chat_template_kwargs` and `add_generation_prompt` (default true), as vLLM passes them."""
        tools = body.get("tools") or None
        kwargs = body.get("chat_template_kwargs")
        return self._template(tools is not None).render(
            _messages(body),
            tools=tools,
            documents=body.get("documents"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            template_kwargs=kwargs if isinstance(kwargs, Mapping) else None,
        )

    def encode(self, text: str, *, add_special_tokens: bool) -> TokenIds:
        """`text`'s ids (special tokens in the text matched as such), cached by text."""
        key = (text, add_special_tokens)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return cached
        self.cache_misses += 1
        ids = tuple(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        self._store(key, ids)
        return ids

    def _store(self, key: tuple[str, bool], ids: TokenIds) -> None:
        if self._cache_entries > 0:
            self._cache[key] = ids
            if len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)

    async def warm(self, text: str, *, add_special_tokens: bool) -> None:
        """Encode a long `text` in a thread and cache it, so that `encode` then finds it
        without encoding on the event loop. In a thread because the Rust encoder releases the
        GIL in `encode_batch` (not in `encode`); the cache is written here, on the loop. A
        short text, or one cached already, is left to `encode` (a thread hop costs more)."""
        key = (text, add_special_tokens)
        if len(text) < OFF_LOOP_CHARS or self._cache_entries <= 0 or key in self._cache:
            return
        [encoding] = await asyncio.to_thread(
            self._tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens
        )
        self._store(key, tuple(encoding.ids))

    def chat_ids(self, body: Mapping[str, Any]) -> TokenIds:
        """A chat request's prompt ids, as vLLM tokenizes the rendered conversation."""
        return self.encode(self.render_chat(body), add_special_tokens=False)

    def completion_ids(self, prompt: str) -> TokenIds:
        """A completions prompt's ids, with the tokenizer's default special tokens (vLLM's)."""
        return self.encode(prompt, add_special_tokens=True)


class PromptTokenizer:
    """Every configured model's tokenizer; any other model is placed by pseudo ids."""

    def __init__(self, models: Mapping[str, ModelTokenizer]) -> None:
        self._models = dict(models)

    @classmethod
    def from_config(cls, placement: PlacementConfig, *, cache_entries: int = 256) -> Self:
        """Load `placement.tokenizers`; a tokenizer that cannot be loaded is a ConfigError
        naming its key (the config check already refused missing paths)."""
        models: dict[str, ModelTokenizer] = {}
        problems = []
        for model, path in placement.tokenizers.items():
            try:
                models[model] = ModelTokenizer.from_path(path, cache_entries=cache_entries)
            except TokenizerLoadError as exc:
                problems.append(f"placement.tokenizers.{model}: {exc}")
        if problems:
            raise ConfigError(problems)
        return cls(models)

    def model(self, name: str) -> ModelTokenizer | None:
        return self._models.get(name)

    def completion(self, model: str, prompt: str | Sequence[int]) -> PromptTokens:
        """One completions prompt's ids: token ids as given, text through the model's tokenizer,
        else pseudo ids."""
        if not isinstance(prompt, str):
            return PromptTokens(tuple(prompt), exact=True)
        tokenizer = self._models.get(model)
        if tokenizer is None:
            return PromptTokens(pseudo_token_ids(prompt), exact=False)
        return PromptTokens(tokenizer.completion_ids(prompt), exact=True)

    async def completion_async(self, model: str, prompt: str | Sequence[int]) -> PromptTokens:
        """`completion`, a long text encoded off the event loop (`ModelTokenizer.warm`)."""
        tokenizer = self._models.get(model)
        if tokenizer is not None and isinstance(prompt, str):
            await tokenizer.warm(prompt, add_special_tokens=True)
        return self.completion(model, prompt)

    def chat(self, model: str, body: Mapping[str, Any]) -> PromptTokens:
        """A chat request's ids through the model's template; pseudo ids over its plain text when
        the model has no tokenizer or template, or the template refuses the conversation (the
        engine will answer that request with its own error)."""
        rendered = self._render(model, body)
        if rendered is None:
            return _chat_by_text(body)
        tokenizer, text = rendered
        return PromptTokens(tokenizer.encode(text, add_special_tokens=False), exact=True)

    async def chat_async(self, model: str, body: Mapping[str, Any]) -> PromptTokens:
        """`chat`, a long conversation encoded off the event loop; rendered once (a template
        costs 40-140 us for a 7-message chat, docs/placement.md)."""
        rendered = self._render(model, body)
        if rendered is None:
            return _chat_by_text(body)
        tokenizer, text = rendered
        await tokenizer.warm(text, add_special_tokens=False)
        return PromptTokens(tokenizer.encode(text, add_special_tokens=False), exact=True)

    def _render(self, model: str, body: Mapping[str, Any]) -> tuple[ModelTokenizer, str] | None:
        tokenizer = self._models.get(model)
        if tokenizer is None or not tokenizer.has_chat_template:
            return None
        try:
            return tokenizer, tokenizer.render_chat(body)
        except ValueError as exc:  # ChatTemplateError included
            log.debug("chat request placed by text for model %s: %s", model, exc)
            return None


def _chat_by_text(body: Mapping[str, Any]) -> PromptTokens:
    """Pseudo ids over a chat's plain text."""
    messages = body.get("messages")
    text = plain_chat_text(messages if isinstance(messages, list) else [])
    return PromptTokens(pseudo_token_ids(text), exact=False)
