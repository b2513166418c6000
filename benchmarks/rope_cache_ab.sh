#!/usr/bin/env bash
# One device call: the rotary (+ q/k norm) and K/V cache write in one launch
# (atom_kernels.rotary_embedding_and_cache, ATOM_FUSED_ROPE_CACHE; issue 17) checked and A/B-timed.
#   bash benchmarks/rope_cache_ab.sh        # results under $OUT (or ./gpu-out)
# 1. Its kernel tests compiled (test_triton_rotary_cache.py, the custom-op schema test, the sm_90
#    compile test) and the engine's float32 greedy parity with transformers in every graph mode
#    (TESTS=0 skips them).
# 2. Decode at batch 1 / 8 for SHAPES (default "qwen3-0.6b llama3-8b"), the switch off (0) then on
#    (1), and a second round on then off.
# 3. The kernel list of a Qwen3-0.6B batch-1 decode step with the switch on (profile_decode.py).
# 4. PREFILL=1 (default): the 16 x 512-token Qwen3-0.6B prefill step (profile_prefill.py, the
#    `full` graphs timed and the eager step's kernels), off and on.
# Each run is skipped when less than its time limit is left of BUDGET_S (default 560 s, for a
# 600 s device call); Llama-3-8B's second round comes last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
. benchmarks/device_env.sh  # wheels, PYTHONPATH, the tests' tokenizer
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
START=$(date +%s)
BUDGET_S=${BUDGET_S:-560}  # the device call's limit, less the summary
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# run_for <seconds it may take> <command...>: runs it under that limit, or skips it (logged)
# when less than that is left of BUDGET_S, so one call always ends with the summary.
run_for() {
    local need=$1; shift
    if [ "$(left)" -lt "$need" ]; then echo "skipped (only $(left) s left): $*"; return; fi
    timeout "$need" "$@" 2>&1 | grep -v Warn | tail -"${TAIL:-2}"
}
decode() {  # decode <shape> <switch> <round>
    ATOM_FUSED_ROPE_CACHE=$2 run_for 120 python3 benchmarks/engine_bench.py decode --shape "$1" \
        --batch-sizes 1 8 --out "$OUT/decode-$1-ropecache$2-r$3.json"
}
if [ "${TESTS:-1}" != 0 ]; then
    ATOM_REQUIRE_GPU=1 TAIL=4 run_for 200 python3 -m pytest -q -p no:cacheprovider -x -rfE \
        --junitxml="$OUT/gpu-tests-rope-cache.xml" \
        packages/atom-kernels/tests/test_triton_rotary_cache.py \
        packages/atom-kernels/tests/test_rotary_cache_compile_sm90.py \
        packages/atom-kernels/tests/test_triton_custom_ops.py \
        packages/atom-engine/tests/test_gpu_engine.py \
        -k "rotary or rope or opcheck or registered or greedy_matches_transformers"
fi
# Off / on pairs, the second round of each shape in the other order; Qwen3-0.6B first.
for shape in ${SHAPES:-qwen3-0.6b llama3-8b}; do decode "$shape" 0 0; decode "$shape" 1 0; done
SHAPES1=${SHAPES:-qwen3-0.6b}
for shape in $SHAPES1; do decode "$shape" 1 1; decode "$shape" 0 1; done
ATOM_FUSED_ROPE_CACHE=1 run_for 90 python3 benchmarks/profile_decode.py --shape qwen3-0.6b \
    --batch-size 1 --out "$OUT/profile-decode-ropecache1.json"
if [ "${PREFILL:-1}" != 0 ]; then
    for v in 0 1; do
        ATOM_FUSED_ROPE_CACHE=$v TAIL=3 run_for 100 python3 benchmarks/profile_prefill.py \
            --prompts 16 --prompt-len 512 --modes full none --repeats 5 --top 12 \
            --out "$OUT/profile-prefill-ropecache$v.json"
    done
fi
for shape in ${SHAPES:-llama3-8b}; do
    [[ " $SHAPES1 " == *" $shape "* ]] || { decode "$shape" 1 1; decode "$shape" 0 1; }
done
OUT=$OUT python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/decode-*ropecache*.json")):
    d = json.load(open(f))
    rows = [
        (r["batch_size"], round(r["step_ms"], 4), round(r.get("fraction_of_bandwidth", 0), 3))
        for r in d["results"]
    ]
    print(os.path.basename(f), "(batch, step ms, fraction of bandwidth):", rows)
for p in glob.glob(f"{out}/profile-decode-ropecache*.json"):
    d = json.load(open(p))
    print(os.path.basename(p), "kernels", d["num_kernels"], "graph_ms", round(d["graph_ms"], 4))
    for k in d["kernels"]:
        print(f"  {k['count']:4d} {k['total_ms']:.4f} ms  {k['kernel'][:70]}")
for p in sorted(glob.glob(f"{out}/profile-prefill-ropecache*.json")):
    d = json.load(open(p))
    steps = {m: round(s["median_ms"], 3) for m, s in d["steps"].items()}
    print(os.path.basename(p), steps, "eager kernels ms", round(d.get("kernel_ms_per_step", 0), 3))
    for k in d.get("kernels", [])[:12]:
        print(f"  {k['ms']:8.3f} ms {k['count']:5d}  {k['name'][:80]}")
PY
