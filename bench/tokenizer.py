"""A tiny local tokenizer directory, so that no router tries to download one.

sglang-router loads a tokenizer from the `model_path` an engine reports (`/server_info`) and
downloads it from the Hugging Face hub unless it is a local directory. The sims are started with
`--model <this directory>`, so the served model name and `model_path` are this path, and the
router finds `tokenizer.json` (a word-level Hugging Face tokenizer) there.
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = 256


def write_tokenizer(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<|endoftext|>"]
    vocab = {w: i for i, w in enumerate([*special, *(f"w{i}" for i in range(WORDS))])}
    added = [
        {
            "id": vocab[w],
            "content": w,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for w in special
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
