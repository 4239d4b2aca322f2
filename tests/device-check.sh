#!/usr/bin/env bash
# `make device-check`, on a GPU machine:
#  1. GPU discovery through the `cuda` feature (cudarc, libcuda loaded at run time): every GPU
#     the driver reports must be listed with its attributes and mapped to a device class.
#  2. The generation contract against a real SGLang or vLLM server (DEVICE_SERVER=sglang|vllm,
#     default vllm) serving SmolLM2 exported as a Hugging Face directory: add/abort, installs
#     under abort and recompute from disk, teacher-forced logprobs against the built-in f32
#     forward. The server is installed in its own virtual environment; where it is neither
#     installed nor installable (no package registry), step 2 says so and is not counted as
#     passed.
# Prebuilt binaries may be handed in (ROLLARC_BIN, DEVICE_CHECK_BIN) for machines without a
# Rust toolchain; otherwise they are built with cargo.
set -euo pipefail
kind="${DEVICE_SERVER:-vllm}"
command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "device-check: no NVIDIA GPU here" >&2; exit 2; }
if [ -z "${ROLLARC_BIN:-}" ]; then
  cargo build -p engine --bin rollarc --features actors/cuda
  ROLLARC_BIN=./target/debug/rollarc
fi
echo "== 1. GPU discovery (cuda feature)"
out="$("$ROLLARC_BIN" devices)"
echo "$out"
gpus="$(nvidia-smi -L | grep -c '^GPU ')"
listed="$(echo "$out" | grep -c '^GPU [0-9]*:' || true)"
[ "$listed" = "$gpus" ] || { echo "device-check: nvidia-smi lists $gpus GPUs, rollarc devices $listed" >&2; exit 1; }
echo "ok: $listed GPU(s) discovered through the CUDA driver API"

echo "== 2. generation contract against $kind"
venv="$HOME/.cache/rollarc/device-$kind"
test -x "$venv/bin/python" || python3 -m venv --system-site-packages "$venv"
case "$kind" in
  vllm) mod=vllm; pkg=vllm ;;
  sglang) mod=sglang; pkg="sglang[all]" ;;
  *) echo "DEVICE_SERVER must be sglang or vllm" >&2; exit 2 ;;
esac
"$venv/bin/python" -c "import $mod" 2>/dev/null || "$venv/bin/pip" install --quiet "$pkg" || {
  echo "device-check: step 2 NOT RUN: $kind is not installed here and could not be installed (no package registry reachable?)"
  exit 3
}
work="$(mktemp -d)"
server_pid=""
trap '[ -n "$server_pid" ] && kill -- -$server_pid 2>/dev/null; rm -rf "$work"' EXIT
if [ -z "${DEVICE_CHECK_BIN:-}" ]; then
  cargo build -p tests --bin device_check
  DEVICE_CHECK_BIN=./target/debug/device_check
fi
"$DEVICE_CHECK_BIN" export "$work/model"
port=8321
case "$kind" in
  vllm) setsid env VLLM_SERVER_DEV_MODE=1 "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
          --model "$work/model" --port $port --dtype float32 --max-model-len 2048 > "$work/server.log" 2>&1 & ;;
  sglang) setsid "$venv/bin/python" -m sglang.launch_server --model-path "$work/model" --port $port \
          --dtype float32 --context-length 2048 > "$work/server.log" 2>&1 & ;;
esac
server_pid=$!
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
"$DEVICE_CHECK_BIN" run "$kind" "http://127.0.0.1:$port" "$work/model" || { tail -50 "$work/server.log"; exit 1; }
