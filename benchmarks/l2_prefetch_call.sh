#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): the L2 prefetch of a decoder layer's
# o_proj and gate_up weights while its attention runs (ATOM_L2_PREFETCH_MB, layers/prefetch.py).
# All under $OUT (carry [".whl", ".bench_assets"]):
#   1. (TESTS=1) GPU tests: the prefetch kernel eagerly and in a graph, the engine's log-probs
#      with it and without (bf16, W4A16; decode graphs, piecewise) (gpu-tests.xml);
#   2. (MICRO=1) benchmarks/l2_prefetch.py: Llama-3-8B's four projections a layer, BUDGETS
#      alternated (l2-prefetch.json); the fastest W4A16 budget at the 8 us window is PICKED;
#   3. (SHAPES) the engine's decode at BATCH_SIZES, ATOM_L2_PREFETCH_MB=0 against the picked
#      budget (or AB_MB), alternated over ROUNDS (decode-ab.json).
#   bash benchmarks/l2_prefetch_call.sh
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
        --junitxml="$OUT/gpu-tests.xml" packages/atom-kernels/tests/test_prefetch.py \
        packages/atom-engine/tests/test_gpu_engine.py -k "${TEST_K:-prefetch}" 2>&1 \
        | grep -v Warn | tail -8
fi
best=${AB_MB:-}
if [ "${MICRO:-1}" = 1 ]; then
    timeout ${MICRO_S:-150} python3 benchmarks/l2_prefetch.py --budgets ${BUDGETS:-0 12 24 36 48} \
        --windows-us ${WINDOWS:-8} --out "$OUT/l2-prefetch.json" 2>&1 | grep -v Warn \
        | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()); continue
    print(r['weights'], 'window', round(r['window_alone_us'], 2), 'us, budget', r['budget_mb'],
          'MB: layer', round(r['layer_us'], 2), 'us, less the window', round(r['layer_less_window_us'], 2))
"
    if [ -z "$best" ]; then
        best=$(python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/l2-prefetch.json"))
rows = [r for r in d["rows"] if r["weights"] == "w4a16" and r["window_us"] == max(
    x["window_us"] for x in d["rows"])]
print(min(rows, key=lambda r: r["layer_us"])["budget_mb"])
PY
)
        echo "picked ATOM_L2_PREFETCH_MB=$best" | tee "$OUT/picked.txt"
    fi
fi
if [ -n "${SHAPES:-llama3-8b-w4a16}" ] && [ -n "$best" ] && [ "$best" != 0 ]; then
    ab=$(mktemp -d)
    OUT=$ab VARIANTS="ATOM_L2_PREFETCH_MB=0;ATOM_L2_PREFETCH_MB=$best" \
        SHAPES="${SHAPES:-llama3-8b-w4a16}" BATCH_SIZES="${BATCH_SIZES:-1}" ROUNDS=${ROUNDS:-2} \
        RUN_S=${RUN_S:-75} BUDGET_S=${AB_BUDGET_S:-320} bash benchmarks/decode_ab.sh 2>&1 | tail -8
    AB=$ab python3 - <<'PY' | tee "$OUT/decode-ab.json"
import glob, json, os
rows = {os.path.basename(f): [(r.get("batch_size"), r["step_ms"]) for r in json.load(open(f))["results"]]
        for f in sorted(glob.glob(os.path.join(os.environ["AB"], "decode-*.json")))}
print(json.dumps(rows, indent=1))
PY
fi
