#!/usr/bin/env bash
# Issue 17 item 1 on one GPU: decode graphs only against decode + piecewise graphs, alternating.
#   bash benchmarks/piecewise_ab.sh     (carry .whl and .bench_assets: README)
# Offline: eager_steps.py (c64-like, 128 x 512/128) and engine_bench.py throughput (nano-vllm
# workload, no transformers); served: serve_ab.sh, one round (atom bench serve at c 1, 16, 64).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh  # wheels, PYTHONPATH, the tests' tokenizer
OUT=${OUT:-$PWD/gpu-out}
MODES=${MODES:-"full_decode_only full_and_piecewise"}
mkdir -p "$OUT"
for m in $MODES; do
    timeout 90 python3 benchmarks/eager_steps.py --requests 128 --cudagraph-mode "$m" \
        --out "$OUT/eager-steps-$m.json" 2>&1 | grep -v Warn | tail -1
done
timeout 90 python3 benchmarks/eager_steps.py --requests 128 --profile-host "$OUT/host-profile.txt" \
    --out "$OUT/eager-steps-profiled.json" 2>&1 | grep -v Warn | tail -1
for m in $MODES; do
    timeout 150 python3 benchmarks/engine_bench.py throughput --shape qwen3-0.6b --workload nanovllm \
        --hf-batch 0 --cudagraph-mode "$m" --out "$OUT/throughput-qwen3-0.6b-$m.json" 2>&1 | tail -4
done
MODES="$MODES" ROUNDS=1 OUT=$OUT bash benchmarks/serve_ab.sh
