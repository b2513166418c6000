#!/usr/bin/env bash
# Issue 40 item 4, the next device call (one H100 / H200): the one-row W4A16 MMAs a warp a row
# with the scale after the MMAs (ATOM_WNA16_ROW_SCALE_AFTER=1; int_quant_row_mma's
# SCALE_AFTER: 4 packed float ops a word fewer, 192 -> 164 instructions a thread's tile on
# sm_90) against the default (each weight scaled and rounded before them). In one call, all
# under $OUT (carry [".whl"]):
#   1. GPU tests: ROW_MMA's PTX with and without the scale after, at the Llama-3-8B sizes
#      (gpu-tests.xml);
#   2. the engine's Llama-3-8B W4A16 decode, batch 1 and 8, the two alternated over two rounds
#      (decode_ab.sh: decode-llama3-8b-w4a16-v{0,1}-*-r{0,1}.json);
#   3. the GEMMs at one row, cold L2, every row checked against the reference: the default tile
#      and the scale-after tiles beside bf16 `linear` (int-scale-after.json);
#   4. the bf16 step in the same call (decode-llama3-8b-bf16.json).
#   bash benchmarks/w4a16_scale_after_call.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
TEST_FILES="packages/atom-kernels/tests/test_triton_int_quant.py" \
    TEST_K="gpu_row_mma or scale_after or chained" TEST_S=130 \
    VARIANTS="ATOM_WNA16_ROW_SCALE_AFTER=0;ATOM_WNA16_ROW_SCALE_AFTER=1" \
    SHAPES=llama3-8b-w4a16 BATCH_SIZES="1 8" ROUNDS=2 RUN_S=70 BUDGET_S=${AB_BUDGET_S:-410} \
    bash benchmarks/decode_ab.sh
. benchmarks/device_env.sh
timeout 80 python3 benchmarks/quant_kernels.py --only int --int-rows 1 \
    --int-impls "row-mma 8 w4 k1 fill8,scale-after,bf16_linear" \
    --out "$OUT/int-scale-after.json" 2>&1 | grep -v Warn | tail -4
timeout 70 python3 benchmarks/engine_bench.py decode --shape llama3-8b --batch-sizes 1 8 \
    --out "$OUT/decode-llama3-8b-bf16.json" 2>&1 | grep -v Warn | tail -2
