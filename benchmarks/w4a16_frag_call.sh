#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): the fragment layout's W4A16 decode
# (int_quant_frag: 4-bit weights repacked at load, one m16n8k16 MMA a word with the weights as
# its 16 rows and the tokens as its columns, a warp's load 512 contiguous bytes, x's loads one
# line a warp). All under $OUT (carry [".whl", ".bench_assets"]):
#   1. GPU tests (TEST_K): the fragment kernel's PTX at the Llama-3-8B sizes, its
#      launches, a CUDA graph chain, the repacked layer, the engine's fragment layout (gpu-tests.xml);
#   2. the one-row (INT_ROWS) GEMMs, cold L2, each checked against the reference: the fragment
#      tiles, the default (ROW_MMA), bf16 `linear` (int-frag.json, and the table printed);
#   3. (AB_VARIANTS) the engine's Llama-3-8B W4A16 decode at BATCH_SIZES, the variants alternated
#      over ROUNDS, then (BF16=1) the bf16 step, the step times in decode-ab.json; (PROFILE=1)
#      profile_decode.py of the W4A16 step with ATOM_WNA16_FRAG=1; (NCU_CASES) ncu of those
#      cases of benchmarks/ncu_targets.py (ncu/summary.json, the table printed).
#   AB_VARIANTS="ATOM_WNA16_FRAG=0;ATOM_WNA16_FRAG=1" bash benchmarks/w4a16_frag_call.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
mkdir -p "$OUT"
. benchmarks/device_env.sh
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, \
'triton', triton.__version__)" | tee "$OUT/device.txt"
if [ "${TESTS:-1}" = 1 ]; then
    ATOM_REQUIRE_GPU=1 timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -rfE \
        --junitxml="$OUT/gpu-tests.xml" packages/atom-kernels/tests/test_triton_int_quant.py \
        packages/atom-models/tests/test_int_quant_load.py packages/atom-engine/tests/test_gpu_engine.py \
        -k "${TEST_K:-frag or fragment}" 2>&1 \
        | grep -v Warn | tail -8
fi
if [ "${SWEEP:-1}" = 1 ]; then
    timeout ${SWEEP_S:-170} python3 benchmarks/quant_kernels.py --only int \
        --int-rows ${INT_ROWS:-1} --int-impls "${IMPLS:-frag,row-mma 8 w4 k1 fill8,bf16_linear}" \
        --out "$OUT/int-frag.json" 2>&1 | grep -v Warn | tail -3
    OUT=$OUT python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/int-frag.json"))
print("copy GB/s", d.get("roofline", {}).get("copy_GBps"))
for r in d["results"]:
    if "ms_cold" not in r:
        print(r.get("shape"), r.get("impl"), "ERROR", r.get("error", "")[:300])
        continue
    print(f"{r['shape'][:26]:26s} {r['impl'][:44]:44s} cold {r['ms_cold'] * 1e3:6.2f} us "
          f"{r.get('of_copy_bandwidth', 0):.0%} of copy{' BAD' if r.get('bad') else ''}")
PY
fi
if [ -n "${NCU_CASES:-}" ]; then
    bash benchmarks/ncu_targets.sh "$OUT/ncu" $NCU_CASES 2>&1 | tail -12
    OUT=$OUT python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/ncu/summary.json"))
for case, kernels in d.items():
    for k in kernels:
        print(case, {key: k.get(key) for key in ("duration", "dram_pct", "achieved_occupancy_pct",
              "theoretical_occupancy_pct", "registers", "grid", "ipc", "l2_hit_pct")},
              k.get("top_stalls"))
PY
    rm -f "$OUT"/ncu/*.csv "$OUT"/ncu/*.err
fi
if [ "${PICK:-0}" = 1 ]; then  # the sweep's fastest fragment launch (sum over the shapes)
    ATOM_WNA16_FRAG_LAUNCH=$(OUT=$OUT python3 - <<'PY'
import json, os, re
d = json.load(open(f"{os.environ['OUT']}/int-frag.json"))
total = {}
for r in d["results"]:
    if "frag" in r["impl"] and "ms_cold" in r and not r.get("bad"):
        total.setdefault(r["impl"], []).append(r["ms_cold"])
best = min((sum(v), k) for k, v in total.items() if len(v) == 4)[1]
m = re.search(r"frag w(\d+) r(\d+) p(\d+) k(\d+)(?: r(\d+))?", best)
warps, rows, per_sm, stages, cap = m.groups()
print(",".join([warps, rows, per_sm, cap or "0", stages]))
PY
)
    export ATOM_WNA16_FRAG_LAUNCH
    echo "picked ATOM_WNA16_FRAG_LAUNCH=$ATOM_WNA16_FRAG_LAUNCH" | tee "$OUT/picked.txt"
fi
if [ -n "${AB_VARIANTS:-}" ]; then
    ab=$(mktemp -d)
    OUT=$ab VARIANTS="$AB_VARIANTS" SHAPES=llama3-8b-w4a16 BATCH_SIZES="${BATCH_SIZES:-1}" \
        ROUNDS=${ROUNDS:-2} RUN_S=${RUN_S:-75} BUDGET_S=${AB_BUDGET_S:-300} \
        bash benchmarks/decode_ab.sh 2>&1 | tail -8
    if [ "${BF16:-0}" = 1 ]; then
        timeout 80 python3 benchmarks/engine_bench.py decode --shape llama3-8b \
            --batch-sizes ${BATCH_SIZES:-1} --out "$ab/decode-llama3-8b-bf16-r0.json" 2>&1 \
            | grep -v Warn | tail -1
    fi
    AB=$ab python3 - <<'PY' | tee "$OUT/decode-ab.json"
import glob, json, os
rows = {os.path.basename(f): [(r.get("batch_size"), r["step_ms"]) for r in json.load(open(f))["results"]]
        for f in sorted(glob.glob(os.path.join(os.environ["AB"], "decode-*.json")))}
print(json.dumps(rows, indent=1))
PY
fi
if [ "${PROFILE:-0}" = 1 ]; then
    ATOM_WNA16_FRAG=1 timeout 120 python3 benchmarks/profile_decode.py --shape llama3-8b-w4a16 \
        --batch-size 1 --out "$OUT/profile-frag-b1.json" 2>&1 | grep -v Warn | tail -14
fi
