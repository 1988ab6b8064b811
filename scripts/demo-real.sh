#!/usr/bin/env bash
# `make demo-real`: the router on 127.0.0.1:8080 in front of one prefill and one decode
# llama-server (Gemma 3 270M on CPU) that hand the KV cache over through slot files.
# Builds llama-server on first use (scripts/get-llama-server.sh, ~4 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
LISTEN="${LISTEN:-127.0.0.1:8080}"
PREFILL_PORT="${PREFILL_PORT:-8091}"
DECODE_PORT="${DECODE_PORT:-8092}"
PARALLEL="${PARALLEL:-2}"

eval "$(PYTHON="$VENV/bin/python" scripts/get-llama-server.sh)"
state="${STATE:-$PWD/state/demo-real}"   # config, logs, handoff and the shared slot directory
slots="$state/slots"
mkdir -p "$slots"

pids=()
# Stop the servers: SIGTERM, then SIGKILL after 5 s (an idle llama-server has been seen to
# ignore a lone SIGTERM).
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=""
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  wait
}
trap cleanup EXIT INT TERM

for port in "$PREFILL_PORT" "$DECODE_PORT"; do
  "$LLAMA_SERVER" -m "$LLAMA_MODEL" --host 127.0.0.1 --port "$port" --alias demo-model \
    --slot-save-path "$slots" --swa-full -np "$PARALLEL" -c $((2048 * PARALLEL)) \
    >"$state/llama-$port.log" 2>&1 &
  pids+=("$!")
done

echo "waiting for both llama-servers to load the model ..."
"$VENV/bin/python" - "$PREFILL_PORT" "$DECODE_PORT" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + 300
for port in sys.argv[1:]:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"llama-server on port {port} not healthy after 300 s; see its log")
        time.sleep(0.2)
PY

cat >"$state/narwhal.yaml" <<YAML
router_id: demo-real
listen: "$LISTEN"
model: demo-model
engines:
  - {id: p0, url: "http://127.0.0.1:$PREFILL_PORT", role: prefill, api: llamacpp, slot_save_path: "$slots"}
  - {id: d0, url: "http://127.0.0.1:$DECODE_PORT", role: decode, api: llamacpp, slot_save_path: "$slots"}
serving: {request_timeout_s: 120, first_token_timeout_s: 60, stream_idle_timeout_s: 30}
engine: {probe_timeout_s: 60}
controller: {monitor_interval_s: 1.0}
handoff: {path: "$state/handoff.json"}
YAML

echo "llama-server logs: $state/llama-*.log; config: $state/narwhal.yaml"
echo "try: curl -s http://$LISTEN/v1/completions -H 'Content-Type: application/json' \\"
echo "       -d '{\"model\": \"demo-model\", \"prompt\": \"Once upon a time\", \"max_tokens\": 32}'"
"$VENV/bin/narwhal-serve" --config "$state/narwhal.yaml"
