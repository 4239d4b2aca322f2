#!/usr/bin/env bash
# `make device-check`: on a GPU machine, installs SGLang or vLLM (DEVICE_SERVER=sglang|vllm,
# default vllm) in its own virtual environment, serves SmolLM2 exported as a Hugging Face
# directory, and runs rollarc's generation contract against the real server (add/abort,
# installs under abort and recompute from disk). Needs a CUDA GPU and the PyPI registry.
set -euo pipefail
kind="${DEVICE_SERVER:-vllm}"
command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "device-check: no NVIDIA GPU here" >&2; exit 2; }
venv="$HOME/.cache/rollarc/device-$kind"
test -x "$venv/bin/python" || python3 -m venv "$venv"
case "$kind" in
  vllm) "$venv/bin/python" -c 'import vllm' 2>/dev/null || "$venv/bin/pip" install --quiet vllm ;;
  sglang) "$venv/bin/python" -c 'import sglang' 2>/dev/null || "$venv/bin/pip" install --quiet "sglang[all]" ;;
  *) echo "DEVICE_SERVER must be sglang or vllm" >&2; exit 2 ;;
esac
work="$(mktemp -d)"
trap 'kill -- -$server_pid 2>/dev/null || true; rm -rf "$work"' EXIT
cargo build -p tests --bin device_check
./target/debug/device_check export "$work/model"
port=8321
case "$kind" in
  vllm) setsid env VLLM_SERVER_DEV_MODE=1 "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
          --model "$work/model" --port $port --dtype float32 --max-model-len 2048 > "$work/server.log" 2>&1 & ;;
  sglang) setsid "$venv/bin/python" -m sglang.launch_server --model-path "$work/model" --port $port \
          --dtype float32 --context-length 2048 > "$work/server.log" 2>&1 & ;;
esac
server_pid=$!
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
./target/debug/device_check run "$kind" "http://127.0.0.1:$port" "$work/model" || { tail -50 "$work/server.log"; exit 1; }
