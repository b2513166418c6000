#!/usr/bin/env bash
# Session 13, call 1: the engine/models GPU suite on the default (argmax off) code with the
# counters check; the DeepSeek-then-Llama sequence with the Triton argmax on (the counters check
# names the test that leaves a counter set; CUDA_LAUNCH_BLOCKING names the faulting kernel);
# Llama-3-8B batch-1 decode on the final defaults.
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/o}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
E=packages/atom-engine/tests
ATOM_REQUIRE_GPU=1 timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE packages/atom-engine packages/atom-models \
  --ignore=$E/test_server_structured.py --ignore=$E/test_structured_output.py > "$O/engine-suite-default.log" 2>&1
tail -3 "$O/engine-suite-default.log"
ATOM_TRITON_ARGMAX=1 ATOM_REQUIRE_GPU=1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE -x \
  $E/test_deepseek_engine.py $E/test_gpu_engine.py -k "deepseek or llama or gpu_greedy" > "$O/argmax-on-seq.log" 2>&1
tail -3 "$O/argmax-on-seq.log"
CUDA_LAUNCH_BLOCKING=1 ATOM_TRITON_ARGMAX=1 ATOM_REQUIRE_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE -x \
  $E/test_deepseek_engine.py $E/test_gpu_engine.py -k "deepseek or llama or gpu_greedy" > "$O/argmax-on-seq-blocking.log" 2>&1
tail -3 "$O/argmax-on-seq-blocking.log"
timeout 100 python3 benchmarks/engine_bench.py decode --shape llama3-8b --batch-sizes 1 --out "$O/decode-llama-bs1.json" 2>&1 | grep -v Warn | tail -3
