#!/usr/bin/env bash
# Start real vLLM (CPU build, venv .venv-vllm from `make test`) serving .cache/tiny-model as "tiny" on 127.0.0.1,
# in the background; wait for /health; print the PID. Stop it with: kill "$(cat /tmp/vllm-PORT.pid)"
#
#   scripts/fidelity/start_vllm.sh 18200 --num-gpu-blocks-override 24    # overload config (replay)
#   scripts/fidelity/start_vllm.sh 18201 --max-num-queued-reqs 32        # calibration + refusal probe
#
# Extra arguments go to the server. Log: /tmp/vllm-PORT.log. Env: VLLM_VENV, MODEL_DIR.
set -euo pipefail
port=${1:?usage: start_vllm.sh PORT [extra vllm args]}
shift
venv=${VLLM_VENV:-.venv-vllm}
model=${MODEL_DIR:-.cache/tiny-model}
log=${TMPDIR:-/tmp}/vllm-$port.log
start=$(date +%s)
HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=1 \
  nohup "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
  --served-model-name tiny --host 127.0.0.1 --port "$port" --dtype float32 \
  --max-model-len 512 --max-num-seqs 16 "$@" >"$log" 2>&1 &
pid=$!
echo "$pid" >"${TMPDIR:-/tmp}/vllm-$port.pid"
for _ in $(seq 1 150); do
  if curl -sf -o /dev/null "http://127.0.0.1:$port/health"; then
    echo "vLLM pid $pid healthy on 127.0.0.1:$port after $(($(date +%s) - start)) s (log $log)"
    exit 0
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "vLLM exited during start-up; see $log" >&2
    exit 1
  fi
  sleep 2
done
echo "vLLM not healthy after 300 s; see $log (pid $pid still running)" >&2
exit 1
