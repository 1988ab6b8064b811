"""Batched prompts and `n > 1` as parts (dataplane/fanout.py): split in vLLM's choice order,
merged back with choices renumbered and usage counted as vLLM counts it."""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.dataplane.fanout import merge, split
from narwhal.dataplane.requests import parse_request


def _parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    req = parse_request("completions", orjson.dumps(body), "m")
    return [
        {"prompt": p.body["prompt"], "seed": p.body.get("seed"), "n": p.body.get("n"),
         "text": p.prompt_text, "count": p.prompt_token_count}
        for p in split(req)
    ]  # fmt: skip


def test_a_batch_of_prompts_with_n_samples_is_prompt_major() -> None:
    parts = _parts({"prompt": ["a b", "c"], "n": 2, "seed": 10, "max_tokens": 3})
    assert parts == [
        {"prompt": "a b", "seed": 10, "n": None, "text": "a b", "count": None},
        {"prompt": "a b", "seed": 11, "n": None, "text": "a b", "count": None},
        {"prompt": "c", "seed": 10, "n": None, "text": "c", "count": None},
        {"prompt": "c", "seed": 11, "n": None, "text": "c", "count": None},
    ]
    ids = _parts({"prompt": [[7, 8, 9], [4]]})
    assert [(p["prompt"], p["text"], p["count"]) for p in ids] == [
        ([7, 8, 9], None, 3), ([4], None, 1),
    ]  # fmt: skip


def test_n_alone_repeats_the_prompt_and_leaves_an_unseeded_request_unseeded() -> None:
    parts = _parts({"prompt": "x", "n": 3})
    assert [p["prompt"] for p in parts] == ["x"] * 3
    assert {p["seed"] for p in parts} == {None}


def _answer(text: str, prompt: int, completion: int) -> bytes:
    return orjson.dumps({
        "id": f"cmpl-{text}", "object": "text_completion", "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion},
    })  # fmt: skip


def test_merge_renumbers_choices_and_counts_each_prompt_once() -> None:
    answers = [_answer("a1", 2, 3), _answer("a2", 2, 1), _answer("b1", 5, 3), _answer("b2", 5, 3)]
    merged = orjson.loads(merge(answers, n=2))
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a1"), (1, "a2"), (2, "b1"), (3, "b2"),
    ]  # fmt: skip
    assert merged["usage"] == {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17}
    assert merged["id"] == "cmpl-a1" and merged["object"] == "text_completion"


def test_merge_without_usage_leaves_it_out() -> None:
    answers = [orjson.dumps({"choices": [{"index": 0, "text": t}]}) for t in ("x", "y")]
    merged = orjson.loads(merge(answers, n=1))
    assert "usage" not in merged and [c["index"] for c in merged["choices"]] == [0, 1]
