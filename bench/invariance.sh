#!/bin/bash
# What batch-invariant mode costs (issue 14): prefixkv with and without it on every workload, one
# command each (both in one process, order rotating, 3 repeats), plus hf-static for output identity.
#   bench/invariance.sh [OUT_DIR]
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-bench/out/invariance}
SYSTEMS=prefixkv-variant,prefixkv-invariant,hf-static
COMMON=(--systems "$SYSTEMS" --repeat 3 --wait-quiet 30 --no-progress --out "$OUT")
set -x
.venv/bin/python -m bench shared-prefix --groups 1 --per-group 16 --system-tokens 196 --question-tokens 32 \
    --output-tokens 32 "${COMMON[@]}" --stem shared-prefix-16x196-o32
.venv/bin/python -m bench multi-turn "${COMMON[@]}" --stem multi-turn-8x4
.venv/bin/python -m bench decode-heavy "${COMMON[@]}" --stem decode-heavy-16x256
.venv/bin/python -m bench cold "${COMMON[@]}" --stem cold-16
.venv/bin/python -m bench parallel-sampling "${COMMON[@]}" --stem parallel-sampling-8x4
