#!/usr/bin/env bash
# `make demo-vllm`: the router on 127.0.0.1:8080 in front of one prefill and one decode vLLM
# (the CPU build, Gemma 3 270M) that hand the KV cache over with the NixlConnector through a CPU
# buffer. Installs vLLM on first use (scripts/get-vllm.sh, ~5 min on 2 cores) and needs ~12 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
LISTEN="${LISTEN:-127.0.0.1:8080}"
PREFILL_PORT="${PREFILL_PORT:-8091}"
DECODE_PORT="${DECODE_PORT:-8092}"

eval "$(PYTHON="$VENV/bin/python" scripts/get-vllm.sh)"
state="${STATE:-$PWD/state/demo-vllm}"   # config, logs and handoff
mkdir -p "$state"

pids=()
# Stop the servers: SIGTERM to each one's process group (its EngineCore and worker too), then
# SIGKILL after 30 s.
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 300); do
    alive=""
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  wait
}
trap cleanup EXIT INT TERM

for spec in "$PREFILL_PORT:kv_producer" "$DECODE_PORT:kv_consumer"; do
  port="${spec%%:*}" role="${spec#*:}"
  # One session per server (setsid), so cleanup can signal its whole process group.
  VLLM_HOST_IP=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 \
  VLLM_NIXL_SIDE_CHANNEL_PORT=$((port + 100)) VLLM_CPU_OMP_THREADS_BIND=nobind \
  OMP_NUM_THREADS=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
  setsid "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
    --model "$VLLM_MODEL" --served-model-name demo-model --host 127.0.0.1 --port "$port" \
    --dtype float32 --max-model-len 2048 --max-num-seqs 4 --block-size 16 \
    --kv-cache-memory-bytes $((512 << 20)) --enforce-eager --enable-prefix-caching \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$((port + 200))\", \"replay_endpoint\": \"tcp://127.0.0.1:$((port + 300))\"}" \
    --kv-transfer-config "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"$role\", \"kv_buffer_device\": \"cpu\"}" \
    >"$state/vllm-$port.log" 2>&1 &
  pids+=("$!")
done

echo "waiting for both vLLM servers to load the model (about a minute each) ..."
"$VENV/bin/python" - "$PREFILL_PORT" "$DECODE_PORT" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + 600
for port in sys.argv[1:]:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"vLLM on port {port} not ready after 600 s; see its log")
        time.sleep(0.5)
PY

cat >"$state/narwhal.yaml" <<YAML
router_id: demo-vllm
listen: "$LISTEN"
model: demo-model
engines:
  - {id: p0, url: "http://127.0.0.1:$PREFILL_PORT", role: prefill}
  - {id: d0, url: "http://127.0.0.1:$DECODE_PORT", role: decode}
serving: {request_timeout_s: 120, first_token_timeout_s: 60, stream_idle_timeout_s: 30}
engine: {probe_timeout_s: 60}
controller: {monitor_interval_s: 1.0}
handoff: {path: "$state/handoff.json"}
YAML

echo "vLLM logs: $state/vllm-*.log; config: $state/narwhal.yaml"
echo "KV events: PUB tcp://127.0.0.1:$((PREFILL_PORT + 200)) (prefill), $((DECODE_PORT + 200)) (decode)"
echo "try: curl -s http://$LISTEN/v1/completions -H 'Content-Type: application/json' \\"
echo "       -d '{\"model\": \"demo-model\", \"prompt\": \"Once upon a time\", \"max_tokens\": 32}'"
"$VENV/bin/narwhal-serve" --config "$state/narwhal.yaml"
