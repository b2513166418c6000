#!/usr/bin/env bash
# Session 31's device calls (issue 42): FlashInfer's prefill in the engine and the in-place fused
# add + RMSNorm. Carry [".whl", ".fi_parts"]; results under $OUT.
#   call 1: bash benchmarks/fi_prefill_call.sh tests    (GPU tests, kernel rows side by side)
#   call 2: bash benchmarks/fi_prefill_call.sh engine   (the same warm machine: engine A/B)
set -uo pipefail
FI_SITE=/tmp/fisite bash benchmarks/flashinfer_parts.sh unpack >/dev/null
. benchmarks/device_env.sh
export PYTHONPATH=/tmp/fisite:$PWD/benchmarks:$PYTHONPATH FLASHINFER_NO_DOWNLOAD=1
export MAX_JOBS=${MAX_JOBS:-14}
gpu_tests() { ATOM_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider -rfE "$@" 2>&1 | tail -25; }
case ${1:-} in
tests)
    # FlashInfer's JIT builds (FA3 prefill at head sizes 64 / 128 / 256) beside the tests that
    # need none of them.
    python3 - >"$OUT/jit.log" 2>&1 <<'PY' &
import time, torch
from atom_kernels.backends.flashinfer.prefill import PagedPrefill
for d in (128, 64, 256):
    t0 = time.time()
    p = PagedPrefill(num_heads=8, num_kv_heads=2, head_dim=d, block_size=16, scale=d**-0.5,
                     dtype=torch.bfloat16, device="cuda")
    p.plan([20], [20], [[0, 1]])
    c = torch.zeros(4, 16, 2, d, dtype=torch.bfloat16, device="cuda")
    p(torch.zeros(20, 8, d, dtype=torch.bfloat16, device="cuda"), c, c)
    torch.cuda.synchronize()
    print(f"head_dim {d}: built and ran in {time.time() - t0:.1f} s", flush=True)
PY
    jit=$!
    gpu_tests --junitxml="$OUT/gpu-tests-norm.xml" packages/atom-kernels/tests/test_triton_norm.py \
        packages/atom-kernels/tests/test_norm.py packages/atom-kernels/tests/test_triton_custom_ops.py \
        packages/atom-engine/tests/test_gpu_engine.py
    wait $jit; cat "$OUT/jit.log"
    gpu_tests --junitxml="$OUT/gpu-tests-fi-prefill.xml" \
        packages/atom-kernels/tests/test_flashinfer_prefill.py \
        packages/atom-engine/tests/test_flashinfer_prefill_engine.py \
        packages/atom-kernels/tests/test_flashinfer.py
    python3 benchmarks/flashinfer_compare.py --only norm,prefill --out "$OUT/fi-norm-prefill.json" 2>&1 | tail -30
    python3 benchmarks/fi_tune.py --only norm --out "$OUT/fi-tune-norm.json" 2>&1 | tail -30
    ;;
engine)
    # Llama-3-8B, 4,000-token prompts: ATOM's prefill attention / FlashInfer's, alternated twice.
    for r in 1 2; do
        for fi in 0 prefill_attention; do
            ATOM_FLASHINFER=$fi python3 benchmarks/engine_bench.py throughput --shape llama3-8b \
                --workload 4000x16 --num-prompts ${PROMPTS:-48} \
                --out "$OUT/tput-llama3-8b-4000x16-$fi-r$r.json" 2>&1 | grep -E "^ATOM|Error|error" | tail -3
        done
    done
    ;;
controls)
    # Where the engine's time went: ATOM's kernel in the piecewise graphs FlashInfer's steps
    # take (full_and_piecewise) beside the mixed graphs, 8,000-token prompts, then 4,000 again.
    python3 -c "from atom_kernels.backends.flashinfer.prefill import PagedPrefill" 2>&1 | tail -2
    run() {  # ATOM_FLASHINFER workload cudagraph_mode
        ATOM_FLASHINFER=$1 python3 benchmarks/engine_bench.py throughput --shape llama3-8b \
            --workload "$2" --num-prompts ${PROMPTS:-48} --cudagraph-mode "$3" \
            --out "$OUT/tput-llama3-8b-$2-$1-$3.json" 2>&1 | grep -E "^ATOM|Error|error" | tail -3
    }
    run 0 8000x16 full; run 0 8000x16 full_and_piecewise; run prefill_attention 8000x16 full
    run 0 4000x16 full_and_piecewise
    ;;
again)
    # After the plan's page list stopped being a blocking copy: 4,000-token prompts both ways.
    python3 - <<'PY' &
import torch
from atom_kernels.backends.flashinfer.prefill import PagedPrefill
p = PagedPrefill(num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, scale=0.1,
                 dtype=torch.bfloat16, device="cuda")
p.plan([20], [20], [[0, 1]])
c = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
p(torch.zeros(20, 8, 128, dtype=torch.bfloat16, device="cuda"), c, c)
torch.cuda.synchronize()
PY
    jit=$!
    ATOM_FLASHINFER=0 python3 benchmarks/engine_bench.py throughput --shape llama3-8b \
        --workload 4000x16 --num-prompts 48 --out "$OUT/tput-llama3-8b-4000x16-0-r3.json" 2>&1 | grep -E "^ATOM|Error"
    wait $jit
    ATOM_FLASHINFER=prefill_attention python3 benchmarks/engine_bench.py throughput --shape llama3-8b \
        --workload 4000x16 --num-prompts 48 --out "$OUT/tput-llama3-8b-4000x16-prefill_attention-r3.json" 2>&1 | grep -E "^ATOM|Error"
    ;;
*) echo "usage: $0 tests|engine|controls|again" >&2; exit 2 ;;
esac
