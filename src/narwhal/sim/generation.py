"""Generated text as a pure function of the context's KV digest.

Token i is a word of a fixed 256-word vocabulary picked by a hash of (digest, i), so a unified run
and a disaggregated run over the same KV produce the same words, and a wrong KV visibly does not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

_ONSETS = "bdfghjklmnprstvz"
_RIMES = ("a", "e", "i", "o", "u", "an", "en", "in", "on", "un", "ar", "er", "ir", "or", "ur", "al")
VOCAB: tuple[str, ...] = tuple(o + r for o in _ONSETS for r in _RIMES)
# Token i's text is its word, with a leading space after the first token; JSON-encoded once so
# streaming only concatenates bytes.
JSON_FIRST: tuple[bytes, ...] = tuple(json.dumps(w).encode() for w in VOCAB)
JSON_NEXT: tuple[bytes, ...] = tuple(json.dumps(" " + w).encode() for w in VOCAB)
_WORDS_PER_HASH = 64  # one 64-byte blake2b digest yields 64 one-byte vocabulary indices


def word_indices(digest: bytes, count: int) -> list[int]:
    """The first `count` generated tokens (vocabulary indices) for a context digest."""
    out: list[int] = []
    for n in range(-(-count // _WORDS_PER_HASH)):
        out.extend(hashlib.blake2b(digest + n.to_bytes(4, "little"), digest_size=64).digest())
    return out[:count]


def token_text(index: int, position: int) -> str:
    return VOCAB[index] if position == 0 else " " + VOCAB[index]


def text_of(indices: Iterable[int]) -> str:
    return "".join(token_text(w, i) for i, w in enumerate(indices))


@dataclass(frozen=True, slots=True)
class Generated:
    indices: tuple[int, ...]
    finish_reason: str  # "length" or "stop"
    stop_reason: str | None  # the stop string that ended it


def generate(
    digest: bytes, max_tokens: int, stop: Iterable[str] = (), min_tokens: int = 0
) -> Generated:
    """Generate up to `max_tokens` words; a word equal to a stop string ends it, unemitted.

    Stop strings are matched against whole words (surrounding spaces ignored) once `min_tokens`
    words have been emitted, as vLLM ignores stop strings before `min_tokens`.
    """
    stops = {s.strip(): s for s in stop}
    words = word_indices(digest, max_tokens)
    if stops:
        for i, w in enumerate(words):
            if i >= min_tokens and VOCAB[w] in stops:
                return Generated(tuple(words[:i]), "stop", stops[VOCAB[w]])
    return Generated(tuple(words), "length", None)
