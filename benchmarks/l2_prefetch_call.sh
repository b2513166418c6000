#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): a decoder layer's next weights asked of L2
# ahead of their GEMM (ATOM_L2_PREFETCH, layers/prefetch.py). All under $OUT (carry [".whl",
# ".bench_assets"]):
#   1. (TESTS=1) GPU tests: the prefetch kernel eagerly and in a graph, the engine's log-probs
#      with every stage on and off (bf16, W4A16; decode graphs, piecewise) (gpu-tests.xml);
#   2. (MICRO=1) benchmarks/l2_prefetch.py: Llama-3-8B's four projections a layer under each
#      plan, alternated (l2-prefetch.json); the fastest plan for AB_WEIGHTS is picked;
#   3. the engine's decode (AB_WEIGHTS w4a16: llama3-8b-w4a16, bf16: llama3-8b) at BATCH_SIZES,
#      ATOM_L2_PREFETCH unset against the picked plan (or AB_PLAN), alternated over ROUNDS
#      (decode-ab.json).
#   bash benchmarks/l2_prefetch_call.sh                          # call 1
#   TESTS=0 MICRO=0 AB_WEIGHTS=bf16 AB_PLAN="attn=32" bash ...  # call 2: the bf16 step
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
mkdir -p "$OUT"
. benchmarks/device_env.sh
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, \
'triton', triton.__version__)" | tee "$OUT/device.txt"
if [ "${TESTS:-1}" = 1 ]; then
    ATOM_REQUIRE_GPU=1 timeout ${TEST_S:-120} python3 -m pytest -q -p no:cacheprovider -rfE \
        --junitxml="$OUT/gpu-tests.xml" packages/atom-kernels/tests/test_prefetch.py \
        packages/atom-engine/tests/test_gpu_engine.py -k "${TEST_K:-prefetch}" 2>&1 \
        | grep -v Warn | tail -8
fi
weights=${AB_WEIGHTS:-w4a16}
best=${AB_PLAN:-}
if [ "${MICRO:-1}" = 1 ]; then
    timeout ${MICRO_S:-120} python3 benchmarks/l2_prefetch.py ${MICRO_ARGS:-} \
        --out "$OUT/l2-prefetch.json" 2>&1 | grep -v Warn | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()); continue
    print(f\"{r['weights']:6s} {r['plan'] or 'off':32s} layer {r['layer_us']:7.2f} us, \"
          f\"less the windows {r['layer_less_windows_us']:7.2f} us ({r['of_copy']:.0%} of copy)\")
"
    if [ -z "$best" ]; then
        best=$(WEIGHTS=$weights python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/l2-prefetch.json"))
rows = [r for r in d["rows"] if r["weights"] == os.environ["WEIGHTS"]]
print(min(rows, key=lambda r: r["layer_us"])["plan"])
PY
)
        echo "picked ATOM_L2_PREFETCH=$best for $weights" | tee "$OUT/picked.txt"
    fi
fi
if [ -n "$best" ]; then
    shape=$([ "$weights" = bf16 ] && echo llama3-8b || echo llama3-8b-w4a16)
    ab=$(mktemp -d)
    OUT=$ab VARIANTS="ATOM_L2_PREFETCH=;ATOM_L2_PREFETCH=$best" SHAPES="$shape" \
        BATCH_SIZES="${BATCH_SIZES:-1}" ROUNDS=${ROUNDS:-2} RUN_S=${RUN_S:-75} \
        BUDGET_S=${AB_BUDGET_S:-300} bash benchmarks/decode_ab.sh 2>&1 | tail -8
    AB=$ab python3 - <<'PY' | tee "$OUT/decode-ab.json"
import glob, json, os
rows = {os.path.basename(f): [(r.get("batch_size"), r["step_ms"]) for r in json.load(open(f))["results"]]
        for f in sorted(glob.glob(os.path.join(os.environ["AB"], "decode-*.json")))}
print(json.dumps(rows, indent=1))
PY
fi
