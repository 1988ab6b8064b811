"""The sim's tokenizer: one token per whitespace-separated word; chat adds template tokens.

Cheap and deterministic on purpose: the router counts tokens through `/tokenize`, and a prompt's
token ids decide its KV blocks and therefore the generated text.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

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
