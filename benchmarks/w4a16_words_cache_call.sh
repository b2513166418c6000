#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): the one-row W4A16 MMAs' weight loads with
# the cache modifiers .cg (L2 only) and .cs (streaming) against the default
# (ATOM_WNA16_WORDS_CACHE, int_quant_row_mma's WORDS_CACHE). All under $OUT (carry [".whl"]):
#   1. GPU tests: the modifiers' sums the default's, the refusals (gpu-tests.xml);
#   2. the GEMMs at one row, cold L2, every row checked against the reference: the default tile
#      and its two modifiers beside bf16 `linear` (int-words-cache.json);
#   3. the engine's Llama-3-8B W4A16 decode at batch 1: default / .cg / .cs alternated over two
#      rounds (decode_ab.sh: decode-llama3-8b-w4a16-v{0,1,2}-*-r{0,1}.json).
#   bash benchmarks/w4a16_words_cache_call.sh   (at commit 7360450, session 34's fourth call: .cg
#   timed the same as the default, .cs does not compile on the device's Triton 3.6; the knob was
#   taken out in the next commit, ATOM_WNA16_WORDS_CACHE is gone since)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
mkdir -p "$OUT"
. benchmarks/device_env.sh
ATOM_REQUIRE_GPU=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE \
    --junitxml="$OUT/gpu-tests.xml" packages/atom-kernels/tests/test_triton_int_quant.py \
    -k "words_cache or refuses_what_it_cannot_take" 2>&1 | grep -v Warn | tail -4
timeout 90 python3 benchmarks/quant_kernels.py --only int --int-rows 1 \
    --int-impls "row-mma 8 w4 k1 fill8,bf16_linear" \
    --out "$OUT/int-words-cache.json" 2>&1 | grep -v Warn | tail -2
OUT=$OUT python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/int-words-cache.json"))
for r in d["results"]:
    print(f"{r['shape'][:22]:22s} {r['impl'][:48]:48s} cold {r['ms_cold'] * 1e3:6.2f} us "
          f"graph {r['ms_graph'] * 1e3:6.2f} us {r['of_roofline']:.0%}{' BAD' if r['bad'] else ''}")
PY
VARIANTS="ATOM_WNA16_WORDS_CACHE=;ATOM_WNA16_WORDS_CACHE=.cg;ATOM_WNA16_WORDS_CACHE=.cs" \
    SHAPES=llama3-8b-w4a16 BATCH_SIZES=1 ROUNDS=2 RUN_S=58 BUDGET_S=${AB_BUDGET_S:-300} \
    bash benchmarks/decode_ab.sh 2>&1 | grep -v Capturing | tail -12
