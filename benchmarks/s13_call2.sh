#!/usr/bin/env bash
# Session 13, call 2: the engine/models GPU suite with the Triton argmax on (after the profile fix),
# then Llama-3-8B batch-1 decode with it off and on, alternating, two rounds.
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/o}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
E=packages/atom-engine/tests
ATOM_TRITON_ARGMAX=1 ATOM_REQUIRE_GPU=1 timeout 290 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE packages/atom-engine packages/atom-models \
  --ignore=$E/test_server_structured.py --ignore=$E/test_structured_output.py > "$O/engine-suite-argmax-on.log" 2>&1
tail -3 "$O/engine-suite-argmax-on.log"
OUT=$O VARIANTS="ATOM_TRITON_ARGMAX=0;ATOM_TRITON_ARGMAX=1" SHAPES=llama3-8b BATCH_SIZES="1" ROUNDS=2 RUN_S=80 BUDGET_S=260 \
  bash benchmarks/decode_ab.sh 2>&1 | tail -8
