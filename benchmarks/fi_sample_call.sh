#!/usr/bin/env bash
# Session 32's second device call (issue 42 item 2): FlashInfer's sampler inside the engine
# against ATOM's filter kernels, now that the sampler warm-up loads both before the first
# request (sampler.warm_up_sampling), alternated in one call: Llama-3-8B decode steps (top-k 50,
# top-p 0.9, temperature 0.8) at batch 1 / 64 / 256, Qwen3-0.6B offline 512 in / 128 out (the run
# session 22 measured at 0.40x). GPU tests first. Carry [".whl", ".fi_parts", ".bench_assets"].
#   bash benchmarks/fi_sample_call.sh         call 2: the decode A/B, then the offline runs
#   bash benchmarks/fi_sample_call.sh again   call 3: the GPU tests (each file its own junit XML,
#                                             cut at its own limit), the offline pair again
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
mkdir -p "$OUT"
FI_SITE=/tmp/fisite bash benchmarks/flashinfer_parts.sh unpack >/dev/null
export PYTHONPATH=/tmp/fisite:$PWD/benchmarks:${PYTHONPATH:-} FLASHINFER_NO_DOWNLOAD=1
export MAX_JOBS=${MAX_JOBS:-14}
if [ "${1:-}" = again ]; then
    . benchmarks/device_env.sh
    export PYTHONPATH=/tmp/fisite:$PWD/benchmarks:$PYTHONPATH
    gpu_tests() {  # gpu_tests <limit s> <name> <pytest args...>
        local limit=$1 name=$2; shift 2
        ATOM_REQUIRE_GPU=1 timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE \
            --junitxml="$OUT/gpu-tests-$name.xml" "$@" 2>&1 | tail -4
    }
    gpu_tests 60 wna16-chain packages/atom-kernels/tests/test_triton_int_quant.py -k chained
    gpu_tests 150 flashinfer packages/atom-kernels/tests/test_flashinfer.py
    gpu_tests 150 engine packages/atom-engine/tests/test_gpu_engine.py
    for v in 0 sample; do
        ATOM_FLASHINFER=$v timeout 110 python3 benchmarks/engine_bench.py throughput \
            --shape qwen3-0.6b --workload 512x128 --hf-batch 0 --sampling filtered \
            --out "$OUT/offline-qwen3-0.6b-fi-$v-again.json" 2>&1 | grep -v Warn | tail -1
    done
    exit 0
fi
TEST_FILES="packages/atom-kernels/tests/test_flashinfer.py packages/atom-engine/tests/test_gpu_engine.py packages/atom-kernels/tests/test_triton_int_quant.py::test_wna16_linear_gpu_chained_in_a_graph" \
    TEST_S=200 VARIANTS="ATOM_FLASHINFER=0;ATOM_FLASHINFER=sample" SHAPES=llama3-8b \
    DECODE_ARGS="--sampling filtered" BATCH_SIZES="1 64 256" ROUNDS=1 RUN_S=110 \
    BUDGET_S=${AB_BUDGET_S:-430} bash benchmarks/decode_ab.sh
. benchmarks/device_env.sh
export PYTHONPATH=/tmp/fisite:$PWD/benchmarks:$PYTHONPATH
for v in 0 sample sample 0; do
    ATOM_FLASHINFER=$v timeout 70 python3 benchmarks/engine_bench.py throughput --shape qwen3-0.6b \
        --workload 512x128 --hf-batch 0 --sampling filtered \
        --out "$OUT/offline-qwen3-0.6b-fi-$v-$((n = ${n:-0} + 1)).json" 2>&1 | grep -v Warn | tail -1
done
