#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): the one-row W4A16 MMAs a warp a row with
# neither the zero nor the scale on the weights (ROW_XSUM: each MMA takes 128 + q, (128 + zero)
# times the chunk's x-sum comes off its dot, then the scale, in fp32; sm_90 SASS 24 -> 17.25
# instructions a word at the default 8 rows, 15.44 at 16) and with every weight load of a step of
# ROW_STEP tiles issued before its math (ROW_AHEAD). All under $OUT (carry [".whl"]):
#   1. GPU tests: ROW_MMA's PTX in every form at the Llama-3-8B sizes (gpu-tests.xml);
#   2. the one-row GEMMs, cold L2, every row checked against the reference: the default tile,
#      the xsum / ahead tiles, bf16 `linear` (int-xsum.json, and the table printed);
#   3. ncu of the default and ROW_AHEAD (4 tiles a step; with XSUM 2), gate_up
#      (ncu/summary.json; session 35's first call, at 8d64ec5, had XSUM at 8 and 16 rows);
#   4. (STEP=1) the engine's Llama-3-8B W4A16 decode at batch 1: VARIANTS alternated over two
#      rounds, and the bf16 step (decode-*.json);
#   5. (AB_VARIANTS) the same after 1-3 in the same call, the step times in decode-ab.json.
#   bash benchmarks/w4a16_xsum_call.sh               # 1-3
#   STEP=1 VARIANTS="...;..." bash benchmarks/w4a16_xsum_call.sh   # 1 (TEST_K) and 4
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
mkdir -p "$OUT"
. benchmarks/device_env.sh
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, \
'triton', triton.__version__)" | tee "$OUT/device.txt"
if [ "${STEP:-0}" = 1 ]; then
    TEST_FILES="packages/atom-kernels/tests/test_triton_int_quant.py" \
        TEST_K="${TEST_K:-xsum_cancels or chained}" TEST_S=100 \
        VARIANTS="${VARIANTS:?set VARIANTS}" SHAPES=llama3-8b-w4a16 BATCH_SIZES="1" ROUNDS=2 \
        RUN_S=70 BUDGET_S=${AB_BUDGET_S:-440} bash benchmarks/decode_ab.sh
    timeout 70 python3 benchmarks/engine_bench.py decode --shape llama3-8b --batch-sizes 1 \
        --out "$OUT/decode-llama3-8b-bf16.json" 2>&1 | grep -v Warn | tail -2
    exit 0
fi
ATOM_REQUIRE_GPU=1 timeout ${TEST_S:-170} python3 -m pytest -q -p no:cacheprovider -rfE \
    --junitxml="$OUT/gpu-tests.xml" packages/atom-kernels/tests/test_triton_int_quant.py \
    -k "gpu_row_mma or xsum" 2>&1 | grep -v Warn | tail -6
timeout ${SWEEP_S:-200} python3 benchmarks/quant_kernels.py --only int --int-rows 1 \
    --int-impls "row-mma 8 w4 k1 fill8,xsum,ahead,bf16_linear" \
    --out "$OUT/int-xsum.json" 2>&1 | grep -v Warn | tail -3
OUT=$OUT python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/int-xsum.json"))
for r in d["results"]:
    print(f"{r['shape'][:22]:22s} {r['impl'][:58]:58s} cold {r['ms_cold'] * 1e3:6.2f} us "
          f"graph {r['ms_graph'] * 1e3:6.2f} us {r['of_roofline']:.0%}{' BAD' if r['bad'] else ''}")
PY
[ "${NCU_CASES:-1}" = 0 ] || bash benchmarks/ncu_targets.sh "$OUT/ncu" \
    w4a16_gate_up_proj_m1_row_mma_k1 w4a16_gate_up_proj_m1_row_strided \
    w4a16_gate_up_proj_m1_row_ahead4 2>&1 | tail -5
tail -n 2 "$OUT"/ncu/*.err 2>/dev/null | tail -12
rm -f "$OUT"/ncu/*.csv "$OUT"/ncu/*.err  # the summary holds what they say (8 files come back)
# 5. (AB_VARIANTS set) the engine's Llama-3-8B W4A16 decode at batch 1, the variants alternated
#    over two rounds, then the bf16 step (one JSON of the step times: at most 8 files come back)
if [ -n "${AB_VARIANTS:-}" ]; then
    ab=$(mktemp -d)
    OUT=$ab VARIANTS="$AB_VARIANTS" SHAPES=llama3-8b-w4a16 BATCH_SIZES="1" ROUNDS=2 RUN_S=70 \
        BUDGET_S=${AB_BUDGET_S:-300} bash benchmarks/decode_ab.sh 2>&1 | tail -6
    timeout 70 python3 benchmarks/engine_bench.py decode --shape llama3-8b --batch-sizes 1 \
        --out "$ab/decode-llama3-8b-bf16-r0.json" 2>&1 | grep -v Warn | tail -1
    AB=$ab python3 - <<'PY' | tee "$OUT/decode-ab.json"
import glob, json, os
rows = {os.path.basename(f): [r["step_ms"] for r in json.load(open(f))["results"]]
        for f in sorted(glob.glob(os.path.join(os.environ["AB"], "decode-*.json")))}
print(json.dumps(rows, indent=1))
PY
fi
