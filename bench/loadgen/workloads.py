"""Prompt workloads for the `cache` suite: who shares which prefix with whom.

A workload is an endless, deterministic sequence of sessions; a session is the prompts one
client sends one after another (one prompt, or the turns of a conversation). Words are the
bench tokenizer's `w0`..`w255` (one token each), drawn from seeded generators, so every arm of
a run sends exactly the same prompts in the same order per client.

- `shared_prefix` (the shape of sglang's generated-shared-prefix set): `groups` long system
  prompts, each session one of them (chosen at random) followed by its own short question.
- `multi_turn`: each session a conversation of `turns` prompts, each the previous one plus an
  answer and a new question (what a chat client re-sends).
- `no_sharing`: each session one prompt of fresh words.

`round` changes the questions and conversations but not the system prompts, so the steps of a
ramp share system prompts (as production traffic does) without repeating whole prompts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

WORDS = tuple(f"w{i}" for i in range(256))
KINDS = ("shared_prefix", "multi_turn", "no_sharing")


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str
    groups: int = 32  # shared_prefix: distinct system prompts
    system_words: int = 768  # a system prompt; multi_turn: the conversation's opening context
    question_words: int = 32
    turns: int = 4  # multi_turn: prompts per conversation
    answer_words: int = 64  # multi_turn: the answer carried into the next turn
    seed: int = 0
    round: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown workload {self.kind!r}: one of {', '.join(KINDS)}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Workload:
        return cls(**doc)

    def sessions(self) -> Iterator[list[str]]:
        """Session 0, 1, 2, ... without end."""
        systems: dict[int, str] = {}
        i = 0
        while True:
            yield self.session(i, systems)
            i += 1

    def session(self, i: int, systems: dict[int, str] | None = None) -> list[str]:
        rng = random.Random(f"{self.kind}:{self.seed}:{self.round}:{i}")
        if self.kind == "shared_prefix":
            group = rng.randrange(self.groups)
            cache = systems if systems is not None else {}
            if group not in cache:
                cache[group] = _words(
                    random.Random(f"system:{self.seed}:{group}"), self.system_words
                )
            return [f"{cache[group]} {_words(rng, self.question_words)}"]
        if self.kind == "multi_turn":
            prompt = f"{_words(rng, self.system_words)} {_words(rng, self.question_words)}"
            turns = [prompt]
            for _ in range(self.turns - 1):
                answer, question = _words(rng, self.answer_words), _words(rng, self.question_words)
                prompt = f"{prompt} {answer} {question}"
                turns.append(prompt)
            return turns
        return [_words(rng, self.system_words + self.question_words)]

    def prompt_tokens(self) -> int:
        """The longest prompt's tokens (every word is one token)."""
        if self.kind == "multi_turn":
            per_turn = self.answer_words + self.question_words
            return self.system_words + self.question_words + (self.turns - 1) * per_turn
        return self.system_words + self.question_words


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))
