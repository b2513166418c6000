#!/usr/bin/env bash
# Session 32's device call (issue 40 item 4): the W4A16 GEMMs launched with PDL (weights
# prefetched into L2 before the wait on the kernel before) against the plain launch, in the
# engine's Llama-3-8B W4A16 decode step, alternated; the bf16 step in the same call; the step's
# kernels (profile_decode.py). Carry [".whl"]; results under $OUT.
#   bash benchmarks/w4a16_pdl_call.sh   (at commit 0f46255: the next commit took PDL out again,
#   measured slower; ATOM_WNA16_PDL is gone since)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
# GPU tests (the W4A16 kernels at every launch, chained in a graph, the layers), then
# ATOM_WNA16_PDL=1 / 0 alternated over two rounds (decode_ab.sh)
TEST_FILES="packages/atom-kernels/tests/test_triton_int_quant.py packages/atom-models/tests/test_int_quant_load.py" \
    TEST_K=gpu TEST_S=200 VARIANTS="ATOM_WNA16_PDL=1;ATOM_WNA16_PDL=0" SHAPES=llama3-8b-w4a16 \
    BATCH_SIZES="1 8" ROUNDS=2 RUN_S=90 BUDGET_S=${AB_BUDGET_S:-420} bash benchmarks/decode_ab.sh
. benchmarks/device_env.sh
timeout 90 python3 benchmarks/engine_bench.py decode --shape llama3-8b --batch-sizes 1 8 \
    --out "$OUT/decode-llama3-8b-bf16.json" 2>&1 | grep -v Warn | tail -2
timeout 80 python3 benchmarks/profile_decode.py --shape llama3-8b-w4a16 --batch-size 1 \
    --out "$OUT/profile-w4a16-b1.json" 2>&1 | grep -v Warn | tail -3
