#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): the engine's Llama-3-8B decode step, W4A16
# (dummy group-128 weights, the default launches) and bf16 alternated over two rounds at batch
# 1 and 8 (decode_ab.sh, the two shapes one after the other in each round; the variant is the
# default, named), then the W4A16 step's kernels (profile_decode.py). Under $OUT (carry [".whl"]):
#   decode-llama3-8b{-w4a16,}-v0-*-r{0,1}.json, profile-w4a16-b1.json
#   bash benchmarks/w4a16_vs_bf16_call.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
VARIANTS="ATOM_WNA16_QUAD=1" SHAPES="llama3-8b-w4a16 llama3-8b" BATCH_SIZES="1 8" ROUNDS=2 \
    RUN_S=75 BUDGET_S=${AB_BUDGET_S:-310} bash benchmarks/decode_ab.sh
. benchmarks/device_env.sh
timeout 80 python3 benchmarks/profile_decode.py --shape llama3-8b-w4a16 --batch-size 1 \
    --out "$OUT/profile-w4a16-b1.json" 2>&1 | grep -v Warn | tail -3
