#!/bin/bash
# prefixkv against vLLM's CPU build (and transformers) on every workload, one command each:
#   tools/peer-vllm-cpu && bench/cpu_peer.sh [OUT_DIR]
# Each command runs all its systems in one process (vLLM in its own interpreter), 3 repeats,
# the order rotating, waiting for a quiet machine before each turn. JSON + PNG into OUT_DIR.
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-bench/out/cpu-peer}
PEERS=${PEERS:-prefixkv,vllm-b32,hf-static,hf-cb}
COMMON=(--repeat 3 --wait-quiet 60 --no-progress --out "$OUT")
tools/peer-vllm-cpu >/dev/null || exit 1
set -x
.venv/bin/python -m bench shared-prefix --groups 1 --per-group 16 --system-tokens 196 --question-tokens 32 \
    --output-tokens 32 --systems "$PEERS,vllm-b16" "${COMMON[@]}" --stem shared-prefix-16x196-o32
.venv/bin/python -m bench shared-prefix --groups 1 --per-group 16 --system-tokens 196 --question-tokens 32 \
    --output-tokens 128 --systems "$PEERS" "${COMMON[@]}" --stem shared-prefix-16x196-o128
.venv/bin/python -m bench multi-turn --systems "$PEERS" "${COMMON[@]}" --stem multi-turn-8x4
.venv/bin/python -m bench decode-heavy --systems "$PEERS" "${COMMON[@]}" --stem decode-heavy-16x256
.venv/bin/python -m bench cold --systems "$PEERS" "${COMMON[@]}" --stem cold-16
.venv/bin/python -m bench parallel-sampling --systems "$PEERS" "${COMMON[@]}" --stem parallel-sampling-8x4
