#!/usr/bin/env bash
# Session 14: item 1's evidence on the current code: the kernels of one 8,192-token prefill step
# (profile_prefill.py) and the nano-vllm offline workload's time by kind of step (engine_bench.py).
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/o}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 200 python3 benchmarks/profile_prefill.py --prompts 16 --prompt-len 512 \
  --out "$O/profile-prefill-16x512.json" 2>&1 | grep -v Warn | tail -25
timeout 200 python3 benchmarks/engine_bench.py throughput --shape qwen3-0.6b --workload nanovllm \
  --hf-batch 0 --out "$O/nanovllm.json" 2>&1 | grep -v Warn | tail -3
python3 - "$O/nanovllm.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
def find(x, key):
    if isinstance(x, dict):
        if key in x: return x[key]
        for v in x.values():
            r = find(v, key)
            if r is not None: return r
    if isinstance(x, list):
        for v in x:
            r = find(v, key)
            if r is not None: return r
print(json.dumps(find(d, "by_step_kind"), indent=0)[:2000])
PY
