"""The sim's tokenizer: one token per whitespace-separated word; chat adds template tokens.

Cheap and deterministic on purpose: the router counts tokens through `/tokenize`, and a prompt's
token ids decide its KV blocks and therefore the generated text.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

_ID_SPACE = 1 << 31
GENERATION_PROMPT = "<|assistant|>"


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % _ID_SPACE


def tokenize(text: str) -> list[int]:
    return [token_id(word) for word in text.split()]


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return " ".join(t for t in texts if isinstance(t, str))
    return ""


def render_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The chat template: one `<|role|> content` line per message, then `<|assistant|>`.

    Each message costs one template token (its role marker) and the generation prompt one more.
    """
    lines = [f"<|{m.get('role', 'user')}|> {_content_text(m.get('content'))}\n" for m in messages]
    if add_generation_prompt:
        lines.append(GENERATION_PROMPT)
    return "".join(lines)


class Tokenizer(Protocol):
    """How an engine turns a request into token ids (and ids back into text)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class WordTokenizer:
    """The default: a token per word (ids are word hashes, so they decode as `<id>`)."""

    def encode(self, text: str) -> list[int]:
        return tokenize(text)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]:
        return tokenize(render_chat(messages, add_generation_prompt))

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(f"<{t}>" for t in ids)


class FileTokenizer:
    """A model's `tokenizer.json` (the `tokenizers` library), so the engine's token ids are
    the ones a router computes with the same file: a completion's text is encoded with the
    special tokens vLLM adds (`add_special_tokens`), a chat's rendered template without."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer  # type: ignore[import-untyped, unused-ignore]

        file = path / "tokenizer.json" if path.is_dir() else path
        self._tokenizer = HfTokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]:
        text = render_chat(messages, add_generation_prompt)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))


WORDS = WordTokenizer()


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer a `--tokenizer` names (a tokenizer.json, or a directory holding one)."""
    return WORDS if path is None else FileTokenizer(Path(path))
