#!/usr/bin/env bash
# Session 13, call 4 (merged main): the sampling GPU tests on the block sampler's final defaults,
# then the nano-vllm offline workload (Qwen3-0.6B shape) with the per-token sampler (gumbel) and
# the block sampler, alternating, two rounds.
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/o}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
K=packages/atom-kernels/tests
ATOM_REQUIRE_GPU=1 timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  $K/test_triton_sampling.py $K/test_triton_sampling_block.py $K/test_sampling.py > "$O/tests-sampling-gpu.log" 2>&1
tail -1 "$O/tests-sampling-gpu.log"
for r in 0 1; do
  for v in gumbel block; do
    [ $r = 1 ] && v=$([ $v = gumbel ] && echo block || echo gumbel)
    ATOM_SAMPLE_KERNEL=$v timeout 120 python3 benchmarks/engine_bench.py throughput --shape qwen3-0.6b \
      --workload nanovllm --hf-batch 0 --out "$O/nanovllm-$v-r$r.json" 2>&1 | grep -v Warn | tail -1
  done
done
