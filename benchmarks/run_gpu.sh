#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks, results as JSON under $OUT (or ./gpu-out).
#   bash benchmarks/run_gpu.sh tests kernels moe decode     # phase 1
#   bash benchmarks/run_gpu.sh throughput serve         # phase 2
#   bash benchmarks/run_gpu.sh tune-linear tune-decode tune-moe   # tile sweeps
#   bash benchmarks/run_gpu.sh tests quant                 # quantized GEMM / MoE, MLA decode
#   bash benchmarks/run_gpu.sh multi_gpu multi_gpu_serve   # 2 or 4 GPUs (nvidia-h200-x2/-x4)
#   bash benchmarks/run_gpu.sh allreduce                   # NCCL vs the peer all-reduce, 2 / 4 GPUs
# GPU_TESTS=<paths> limits the tests phase to some test files; GPU_TESTS_EXITFIRST=0 runs them all
# past a failure (no -x). RUN_BUDGET_S=<s>: the quant phase gets what is left of that many seconds
# since the start (a device call's limit), 270 s without it.
# multi_gpu: `pytest -m multi_gpu` over test_multi_gpu.py (GPU_TESTS: other paths; collecting only
# that file keeps other modules' imports of packages the image lacks out of it) for at most
# MULTI_GPU_TESTS_S (330 s: the whole file, budgeted at 5 minutes a machine kind; the cases that
# need more GPUs than the machine has skip), then benchmarks/multi_gpu.py
# with what is left of RUN_BUDGET_S (540 s without it); MULTI_GPU_TESTS=0 skips the tests,
# MULTI_GPU_BENCH=0 the benchmarks, MULTI_GPU_CASES="<case> ..." runs only those benchmark cases
# (to finish a run that was cut short). multi_gpu_serve: test_multi_gpu_serve.py (`atom serve`
# over 2 and 4 GPUs, killed ranks) for at most MULTI_GPU_SERVE_S (400 s). Results are named by
# the machine: multi-gpu-<GPUs>x<name>.json (e.g. multi-gpu-4xh200.json), the tests' logs too.
# Needs the wheels the GPU image lacks in .whl (../shared/device/fetch-wheels.sh) and the bundled
# tokenizer in .bench_assets/tokenizer (for the serving benchmark's text prompts).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
START=$(date +%s)
mkdir -p "$OUT"
. benchmarks/device_env.sh  # wheels, PYTHONPATH, the tests' tokenizer
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
# <GPUs this run sees (CUDA_VISIBLE_DEVICES, else all)>x<name>, e.g. 4xh200
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
    | awk -v visible="${CUDA_VISIBLE_DEVICES-unset}" '
           NR == 1 { n = tolower($0); gsub(/^nvidia /, "", n); split(n, w, " "); name = w[1] }
           END { if (visible != "unset") NR = split(visible, v, ",");
                 if (NR) print NR "x" name; else print "nogpu" }')
MULTI_GPU_PYTEST=(-q -p no:cacheprovider -rfEP --durations=0 -o faulthandler_timeout=150)
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

for phase in "$@"; do
    echo "=== $phase ($(date +%T))"
    case $phase in
    tests)
        exitfirst=-x
        [ "${GPU_TESTS_EXITFIRST:-1}" = 0 ] && exitfirst=
        ATOM_REQUIRE_GPU=1 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider $exitfirst \
            -rfE --junitxml="$OUT/gpu-tests.xml" --ignore=packages/atom-vllm-plugin \
            --ignore=packages/atom-sglang-plugin ${GPU_TESTS:-packages} 2>&1 \
            | tee "$OUT/gpu-tests.log" | tail -60 ;;
    quant)
        left=270
        [ -n "${RUN_BUDGET_S:-}" ] && left=$(( RUN_BUDGET_S - ($(date +%s) - START) ))
        echo "quant: ${left} s left"
        [ "$left" -lt 20 ] && { echo "quant: skipped, no time left"; continue; }
        timeout "$left" python3 benchmarks/quant_kernels.py --out "$OUT/quant-kernels.json" 2>&1 \
            | tee "$OUT/quant-kernels.log" | grep -v '^{' | tail -150 ;;
    multi_gpu)
        if [ "${MULTI_GPU_TESTS:-1}" != 0 ]; then
            ATOM_REQUIRE_GPU=1 timeout "${MULTI_GPU_TESTS_S:-330}" python3 -m pytest -m multi_gpu \
                "${MULTI_GPU_PYTEST[@]}" --junitxml="$OUT/multi-gpu-tests-$GPU_TAG.xml" \
                ${GPU_TESTS:-packages/atom-engine/tests/test_multi_gpu.py} 2>&1 \
                | tee "$OUT/multi-gpu-tests-$GPU_TAG.log" | tail -60
        fi
        [ "${MULTI_GPU_BENCH:-1}" = 0 ] && continue
        left=$(( ${RUN_BUDGET_S:-540} - ($(date +%s) - START) ))
        echo "multi_gpu benchmarks: ${left} s left"
        only=()
        [ -n "${MULTI_GPU_CASES:-}" ] && only=(--only $MULTI_GPU_CASES)
        timeout "$(( left > 30 ? left + 20 : 50 ))" python3 benchmarks/multi_gpu.py --budget-s="$left" \
            ${only[@]+"${only[@]}"} --out "$OUT/multi-gpu-$GPU_TAG.json" 2>&1 \
            | tee "$OUT/multi-gpu-$GPU_TAG.log" | grep -v Warning | tail -60 ;;
    multi_gpu_serve)
        ATOM_REQUIRE_GPU=1 timeout "${MULTI_GPU_SERVE_S:-400}" python3 -m pytest -m multi_gpu \
            "${MULTI_GPU_PYTEST[@]}" --junitxml="$OUT/multi-gpu-serve-$GPU_TAG.xml" \
            packages/atom-engine/tests/test_multi_gpu_serve.py 2>&1 \
            | tee "$OUT/multi-gpu-serve-$GPU_TAG.log" | tail -40 ;;
    allreduce)
        worlds=2; [ "$(nvidia-smi -L | wc -l)" -ge 4 ] && worlds="2 4"
        timeout 300 python3 benchmarks/allreduce.py --world $worlds \
            --out "$OUT/allreduce-$GPU_TAG.json" 2>&1 | tee "$OUT/allreduce-$GPU_TAG.log" | tail -40 ;;
    kernels)
        timeout 240 python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tail -40 ;;
    tune-linear)
        timeout 280 python3 benchmarks/tune_linear.py --out "$OUT/tune-linear.json" 2>&1 | tail -40 ;;
    tune-decode)
        timeout 200 python3 benchmarks/tune_decode.py --default-only --out "$OUT/tune-decode.json" \
            2>&1 | tail -40 ;;
    tune-moe)
        timeout 280 python3 benchmarks/tune_moe.py --out "$OUT/tune-moe.json" 2>&1 | tail -30 ;;
    moe)
        timeout 150 python3 benchmarks/moe.py --out "$OUT/moe.json" 2>&1 | tail -12 ;;
    decode)
        for shape in qwen3-0.6b llama3-8b; do
            timeout 200 python3 benchmarks/engine_bench.py decode --shape $shape \
                --out "$OUT/decode-$shape.json" 2>&1 | grep -v Warning | tail -8
        done ;;
    decode-int)  # issue 40: W4A16 / W8A8 Llama-3-8B against bf16, batch 1
        for shape in llama3-8b llama3-8b-w4a16 llama3-8b-w8a8; do
            timeout 200 python3 benchmarks/engine_bench.py decode --shape $shape --batch-sizes 1 \
                --out "$OUT/decode-$shape.json" 2>&1 | grep -v Warning | tail -8
        done ;;
    throughput)
        timeout 280 python3 benchmarks/engine_bench.py throughput --shape qwen3-0.6b \
            --workload nanovllm --hf-batch 64 256 --hf-prompts 64 --out "$OUT/throughput-qwen3-0.6b.json" 2>&1 | tail -5
        timeout 280 python3 benchmarks/engine_bench.py throughput --shape llama3-8b \
            --workload 512x256 --hf-batch 64 256 --hf-prompts 64 --out "$OUT/throughput-llama3-8b.json" 2>&1 | tail -5 ;;
    serve)
        model=$(python3 benchmarks/shapes.py qwen3-0.6b .bench_assets/tokenizer /tmp/qwen3-serve)
        python3 -m atom_engine.cli.main serve --model "$model" --load-format dummy --port 8011 \
            --max-num-seqs 128 --uvicorn-log-level warning > "$OUT/serve.log" 2>&1 &
        server=$!
        for _ in $(seq 1 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
        for c in 1 16 64; do
            n=$(( c == 1 ? 16 : 4 * c ))
            timeout 200 python3 -m atom_engine.cli.main bench serve --base-url http://127.0.0.1:8011 \
                --tokenizer .bench_assets/tokenizer --num-prompts $n --max-concurrency $c \
                --random-input-len 512 --random-output-len 128 --ignore-eos --save-result \
                --result-dir "$OUT" --result-filename "serve-c$c.json" 2>&1 | tail -24
        done
        kill $server ;;
    esac
done
echo "=== done ($(date +%T))"; ls -la "$OUT"
