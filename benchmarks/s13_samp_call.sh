#!/usr/bin/env bash
# Session 13, the sampler call (issue 17 item 1): the sampling GPU tests (both kernels: "gumbel",
# noise per token; "block", noise per block then per token), then benchmarks/sample_ab.py (the
# two alternating, batch 1-256 at Qwen3's vocabulary, bf16 / fp32, T 1.0 / 0.6, with the time
# to read the logits; a sweep of the block kernel's tiling). Under 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/o}; mkdir -p "$O"
export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:) PYTHONUNBUFFERED=1
K=packages/atom-kernels/tests
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.txt" 2>&1
ATOM_REQUIRE_GPU=1 timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  $K/test_triton_sampling.py $K/test_triton_sampling_block.py $K/test_sampling.py \
  > "$O/tests-gpu.log" 2>&1
tail -3 "$O/tests-gpu.log"
timeout 30 python3 -m pytest -q -p no:cacheprovider -rfE $K/test_sampling_compile_sm90.py \
  > "$O/tests-compile.log" 2>&1
tail -1 "$O/tests-compile.log"
timeout 110 python3 benchmarks/sample_ab.py --out "$O/sample_ab.json" --budget-s 90 \
  > "$O/sample_ab.log" 2>&1
echo "bench rc=$?"; grep -c '"T"' "$O/sample_ab.log"; grep -c block_v "$O/sample_ab.log"
