#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): the one-row W4A16 MMAs a warp a row with
# each program's K span asked of L2 before the loop (ATOM_WNA16_L2_PREFETCH=1: one bulk
# prefetch a row, int_quant_row_mma's L2_PREFETCH) and with the scale after the MMAs
# (ATOM_WNA16_ROW_SCALE_AFTER=1), against the default. All under $OUT (carry [".whl"]):
#   1. GPU tests: ROW_MMA's PTX plain, with the scale after and with the prefetch (its sums the
#      very ones without it), the refusals (gpu-tests.xml);
#   2. the GEMMs at one row, cold L2, every row checked against the reference: the default
#      tile, the scale-after and the prefetch tiles beside bf16 `linear` (int-l2-prefetch.json);
#   3. the engine's Llama-3-8B W4A16 decode, batch 1: default / prefetch / scale after,
#      alternated over two rounds (decode_ab.sh: decode-llama3-8b-w4a16-v{0,1,2}-*-r{0,1}.json).
# The bf16 step is the next call's (the chosen default against bf16, alternated).
#   bash benchmarks/w4a16_l2_prefetch_call.sh   (at commit 990022f, session 34's first call:
#   both measured slower; the prefetch was taken out after 371cfed, ATOM_WNA16_L2_PREFETCH is gone since)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
mkdir -p "$OUT"
. benchmarks/device_env.sh
ATOM_REQUIRE_GPU=1 timeout 130 python3 -m pytest -q -p no:cacheprovider -rfE \
    --junitxml="$OUT/gpu-tests.xml" packages/atom-kernels/tests/test_triton_int_quant.py \
    -k "gpu_row_mma or refuses_what_it_cannot_take" 2>&1 | grep -v Warn | tail -6
timeout 90 python3 benchmarks/quant_kernels.py --only int --int-rows 1 \
    --int-impls "row-mma 8 w4 k1 fill8,scale-after,l2-prefetch,bf16_linear" \
    --out "$OUT/int-l2-prefetch.json" 2>&1 | grep -v Warn | tail -4
VARIANTS="ATOM_WNA16_L2_PREFETCH=0;ATOM_WNA16_L2_PREFETCH=1;ATOM_WNA16_ROW_SCALE_AFTER=1" \
    SHAPES=llama3-8b-w4a16 BATCH_SIZES=1 ROUNDS=2 RUN_S=58 BUDGET_S=${AB_BUDGET_S:-350} \
    bash benchmarks/decode_ab.sh
