#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): the one-row W4A16 MMAs asking L2 for their
# words 1 or 2 steps ahead (ATOM_WNA16_L2_AHEAD, int_quant_row_mma's L2_AHEAD: one
# prefetch.global.L2 a 128-byte line) against the default. All under $OUT (carry [".whl"]):
#   1. GPU tests: its sums the default's, the refusals (gpu-tests.xml);
#   2. the GEMMs at one row, cold L2, every row checked against the reference: the default tile
#      and its prefetch distances beside bf16 `linear` (int-l2-ahead.json);
#   3. the engine's Llama-3-8B W4A16 decode at batch 1: 0 / 1 / 2 steps ahead alternated over
#      two rounds (decode_ab.sh: decode-llama3-8b-w4a16-v{0,1,2}-*-r{0,1}.json).
#   bash benchmarks/w4a16_l2_ahead_call.sh   (at commit 6453d11, session 34's fifth call: both
#   distances slower; the prefetch was taken out in the next commit, ATOM_WNA16_L2_AHEAD is gone)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
mkdir -p "$OUT"
. benchmarks/device_env.sh
ATOM_REQUIRE_GPU=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE \
    --junitxml="$OUT/gpu-tests.xml" packages/atom-kernels/tests/test_triton_int_quant.py \
    -k "l2_ahead or refuses_what_it_cannot_take" 2>&1 | grep -v Warn | tail -4
timeout 90 python3 benchmarks/quant_kernels.py --only int --int-rows 1 \
    --int-impls "row-mma 8 w4 k1 fill8,bf16_linear" \
    --out "$OUT/int-l2-ahead.json" 2>&1 | grep -v Warn | tail -1
OUT=$OUT python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/int-l2-ahead.json"))
for r in d["results"]:
    if "ms_cold" in r:
        print(f"{r['shape'][:22]:22s} {r['impl'][:48]:48s} cold {r['ms_cold'] * 1e3:6.2f} us "
              f"graph {r['ms_graph'] * 1e3:6.2f} us {r['of_roofline']:.0%}"
              f"{' BAD' if r['bad'] else ''}")
    else:
        print(f"{r['shape'][:22]:22s} {r['impl'][:48]:48s} failed")
PY
VARIANTS="ATOM_WNA16_L2_AHEAD=0;ATOM_WNA16_L2_AHEAD=1;ATOM_WNA16_L2_AHEAD=2" \
    SHAPES=llama3-8b-w4a16 BATCH_SIZES=1 ROUNDS=2 RUN_S=58 BUDGET_S=${AB_BUDGET_S:-290} \
    bash benchmarks/decode_ab.sh 2>&1 | grep -v Capturing | tail -12
