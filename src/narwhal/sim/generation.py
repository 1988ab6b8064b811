"""Generated text as a pure function of the context: each token is picked by the digest of
everything before it, the prompt and the tokens generated so far.

Token i is a word of a fixed 256-word vocabulary, so:
- a unified run and a disaggregated run over the same KV produce the same words, and a wrong
  KV visibly does not;
- a generation continued from the prompt plus its first k generated tokens (as token ids)
  produces exactly the tokens from k on of the uninterrupted run: what a router that moves a
  stream to another engine mid-generation must show its client.

Every token's text is its word after a space (as sentencepiece tokenizers mark word starts),
so the text of a continued generation joins the text delivered before it exactly.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from narwhal.sim.kv import BLOCK_SIZE, digest
from narwhal.sim.tokens import token_id

_ONSETS = "bdfghjklmnprstvz"
_RIMES = ("a", "e", "i", "o", "u", "an", "en", "in", "on", "un", "ar", "er", "ir", "or", "ur", "al")
VOCAB: tuple[str, ...] = tuple(o + r for o in _ONSETS for r in _RIMES)
VOCAB_IDS: tuple[int, ...] = tuple(token_id(w) for w in VOCAB)
# Token i's text, JSON-encoded once so streaming only concatenates bytes.
JSON_WORD: tuple[bytes, ...] = tuple(json.dumps(" " + w).encode() for w in VOCAB)


class RollingDigest:
    """`kv.digest` of a growing context, one hash per appended token instead of one per block
    of the whole context."""

    def __init__(self, context: Sequence[int]) -> None:
        full = len(context) - len(context) % BLOCK_SIZE
        self._chain = digest(context[:full])
        self._tail = list(context[full:])

    def value(self) -> bytes:
        if not self._tail:
            return self._chain
        chunk = array("I", self._tail).tobytes()
        return hashlib.blake2b(self._chain + chunk, digest_size=16).digest()

    def append(self, token: int) -> None:
        self._tail.append(token)
        if len(self._tail) == BLOCK_SIZE:
            self._chain = self.value()
            self._tail.clear()


def token_text(index: int) -> str:
    return " " + VOCAB[index]


def text_of(indices: Iterable[int]) -> str:
    return "".join(token_text(w) for w in indices)


@dataclass(frozen=True, slots=True)
class Generated:
    indices: tuple[int, ...]
    finish_reason: str  # "length" or "stop"
    stop_reason: str | None  # the stop string that ended it

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(VOCAB_IDS[w] for w in self.indices)


def generate(
    context: Sequence[int], max_tokens: int, stop: Iterable[str] = (), min_tokens: int = 0
) -> Generated:
    """Generate up to `max_tokens` words after `context` (token ids); a word equal to a stop
    string ends it, unemitted.

    Stop strings are matched against whole words (surrounding spaces ignored) once `min_tokens`
    words have been emitted, as vLLM ignores stop strings before `min_tokens`.
    """
    stops = {s.strip(): s for s in stop}
    rolling = RollingDigest(context)
    words: list[int] = []
    for i in range(max_tokens):
        word = rolling.value()[0]
        if stops and i >= min_tokens and VOCAB[word] in stops:
            return Generated(tuple(words), "stop", stops[VOCAB[word]])
        words.append(word)
        rolling.append(VOCAB_IDS[word])
    return Generated(tuple(words), "length", None)
