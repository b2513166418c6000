#!/usr/bin/env bash
# One device call: the batch-1 decode fusions of atom_kernels.backends.triton.gated_linear checked
# and A/B-timed: gate/up GEMM + SiLU-and-mul (ATOM_FUSED_GATE_UP), the post-attention norm in
# front of it (ATOM_FUSED_NORM_GATE_UP), the input norm in front of the QKV GEMM
# (ATOM_FUSED_NORM_QKV).
#   bash benchmarks/fused_gate_up_ab.sh        # results under $OUT (or ./gpu-out)
# Its kernel tests (compiled), the gate/up tile sweep against cuBLAS + silu_and_mul (TUNE=0
# skips it), Qwen3-0.6B decode at batch 1 / 8 for each of VARIANTS (three digits: the three
# switches in that order; default "000 100 111": unfused, gate/up fused, all), ROUNDS rounds
# (default 2) interleaved, and the kernel list of the last variant's step. SHAPES="qwen3-0.6b
# llama3-8b" times Llama-3-8B's decode too (default: Qwen3-0.6B only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
. benchmarks/device_env.sh  # wheels, PYTHONPATH, the tests' tokenizer
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -x -rfE \
    packages/atom-kernels/tests/test_triton_gated_linear.py \
    packages/atom-kernels/tests/test_gated_linear_compile_sm90.py 2>&1 | tail -4
if [ "${TUNE:-1}" != 0 ]; then
    timeout 150 python3 benchmarks/tune_gated_linear.py --budget-s "${TUNE_BUDGET_S:-90}" \
        --out "$OUT/tune-gated-linear.json" 2>&1 | grep -v Warn | tail -8
fi
variants=${VARIANTS:-000 100 111}
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
    for shape in ${SHAPES:-qwen3-0.6b}; do
        for v in $variants; do
            ATOM_FUSED_GATE_UP=${v:0:1} ATOM_FUSED_NORM_GATE_UP=${v:1:1} \
                ATOM_FUSED_NORM_QKV=${v:2:1} timeout 110 python3 benchmarks/engine_bench.py \
                decode --shape "$shape" --batch-sizes 1 8 \
                --out "$OUT/decode-$shape-fused$v-r$round.json" 2>&1 | grep -v Warn | tail -2
        done
    done
done
last=${variants##* }
ATOM_FUSED_GATE_UP=${last:0:1} ATOM_FUSED_NORM_GATE_UP=${last:1:1} \
    ATOM_FUSED_NORM_QKV=${last:2:1} timeout 90 python3 benchmarks/profile_decode.py \
    --shape qwen3-0.6b --batch-size 1 --out "$OUT/profile-fused$last.json" 2>&1 | grep -v Warn | tail -2
OUT=$OUT python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/decode-*.json")):
    d = json.load(open(f))
    print(os.path.basename(f), [(r["batch_size"], round(r["step_ms"], 4)) for r in d["results"]])
for p in glob.glob(f"{out}/profile-*.json"):
    d = json.load(open(p))
    print(os.path.basename(p), "kernels", d["num_kernels"], "graph_ms", round(d["graph_ms"], 4))
    for k in d["kernels"]:
        print(f"  {k['count']:4d} {k['total_ms']:.4f} ms  {k['kernel'][:70]}")
PY
