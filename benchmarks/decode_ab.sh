#!/usr/bin/env bash
# One device call: GPU tests, then decode latency (`engine_bench.py decode`) under environment
# variants, the variants alternating inside each round and every other round in reverse order
# (the call's drift hits them alike), then an optional kernel tune, all inside one time budget.
#   VARIANTS="ATOM_TRITON_ARGMAX=0;ATOM_TRITON_ARGMAX=1" SHAPES="llama3-8b" ROUNDS=2 \
#       bash benchmarks/decode_ab.sh          # results under $OUT (or ./gpu-out)
# A variant is a space-separated list of NAME=VALUE; variants are separated by ';'. TREE=<dir>
# in a variant runs another source tree (its packages/*/src and benchmarks/engine_bench.py), e.g.
# a commit before a refactor, `git archive REV packages benchmarks | tar -x -C .before` carried
# as .before: VARIANTS="TREE=;TREE=.before" (an empty TREE is this checkout).
# TEST_FILES / TEST_K: pytest files and -k expression run first (ATOM_REQUIRE_GPU=1; none: skip).
# TUNE: a command run last with what is left of the budget, at least 60 s (none: skip); it may
# read its own budget from $TUNE_BUDGET_S.
# DECODE_ARGS: more engine_bench decode arguments (e.g. --cudagraph-mode full_decode_only).
# BATCH_SIZES (default "1 8"), RUN_S per decode run (default 100), BUDGET_S (default 540): a step
# is skipped, logged, when less than its limit is left, so the call ends with the table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
. benchmarks/device_env.sh  # wheels, PYTHONPATH, the tests' tokenizer
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, \
'triton', triton.__version__)" | tee "$OUT/device.txt"
START=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
run_for() {  # run_for <seconds> <command...>: under that limit, or skipped when less is left
    local need=$1; shift
    if [ "$(left)" -lt "$need" ]; then echo "skipped (only $(left) s left): $*"; return; fi
    timeout "$need" "$@" 2>&1 | grep -v Warn | tail -"${TAIL:-2}"
}
if [ -n "${TEST_FILES:-}" ]; then
    ATOM_REQUIRE_GPU=1 TAIL=6 run_for "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider \
        -rfE --junitxml="$OUT/gpu-tests.xml" $TEST_FILES ${TEST_K:+-k "$TEST_K"}
fi
IFS=';' read -r -a variants <<< "${VARIANTS:?set VARIANTS, e.g. ATOM_PDL=0;ATOM_PDL=1}"
n=${#variants[@]}
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
    for shape in ${SHAPES:-llama3-8b}; do
        for j in $(seq 0 $(( n - 1 ))); do
            i=$(( round % 2 == 0 ? j : n - 1 - j ))
            tag=$(echo "${variants[$i]}" | tr -c 'A-Za-z0-9=_,\n' '_' | tr '=,' '-.')
            echo "round $round $shape: ${variants[$i]}"
            (
                export ${variants[$i]}
                bench=benchmarks/engine_bench.py
                if [ -n "${TREE:-}" ]; then
                    PYTHONPATH=$(ls -d "$TREE"/packages/*/src | paste -sd:):${PYTHONPATH##*/src:}
                    export PYTHONPATH
                    bench=$TREE/benchmarks/engine_bench.py
                fi
                run_for "${RUN_S:-100}" python3 "$bench" decode --shape "$shape" \
                    --batch-sizes ${BATCH_SIZES:-1 8} ${DECODE_ARGS:-} \
                    --out "$OUT/decode-$shape-v$i-$tag-r$round.json"
            )
        done
    done
done
# The tune takes what is left (at least 60 s), its own budget 25 s less (TUNE_BUDGET_S).
if [ -n "${TUNE:-}" ] && [ "$(left)" -ge 60 ]; then
    TUNE_BUDGET_S=$(( $(left) - 25 )) TAIL=40 run_for "$(( $(left) - 5 ))" bash -c "$TUNE"
fi
OUT=$OUT python3 - <<'PY'
import glob, json, os, re
rows = {}
for f in sorted(glob.glob(f"{os.environ['OUT']}/decode-*-r*.json")):
    name = os.path.basename(f)
    key = re.sub(r"-r\d+\.json$", "", name)
    d = json.load(open(f))
    for r in d["results"]:
        rows.setdefault((key, r["batch_size"]), []).append(
            (round(r["step_ms"], 4), round(r["fraction_of_bandwidth"], 4))
        )
for (key, bs), vals in sorted(rows.items()):
    print(f"{key:70s} bs={bs:<3d} " + "  ".join(f"{ms:.4f} ms ({fr:.1%})" for ms, fr in vals))
PY
