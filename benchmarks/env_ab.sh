#!/usr/bin/env bash
# One device call: decode latency (`engine_bench.py decode`) under environment variants, the
# variants alternating inside each round, so the call's drift hits them alike.
#   VARIANTS="ATOM_PDL=0;ATOM_PDL=1" SHAPES="qwen3-0.6b llama3-8b" ROUNDS=2 \
#       bash benchmarks/env_ab.sh            # results under $OUT (or ./gpu-out)
# A variant is a space-separated list of NAME=VALUE; variants are separated by ';'.
# BATCH_SIZES (default "1 8"), TIMEOUT_S per run (default 110). Prints a table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
IFS=';' read -r -a variants <<< "${VARIANTS:?set VARIANTS, e.g. ATOM_PDL=0;ATOM_PDL=1}"
for round in $(seq 0 $(( ${ROUNDS:-2} - 1 ))); do
    for shape in ${SHAPES:-qwen3-0.6b}; do
        for i in "${!variants[@]}"; do
            tag=$(echo "${variants[$i]}" | tr -c 'A-Za-z0-9=_\n' '_' | tr '=' '-')
            env ${variants[$i]} timeout "${TIMEOUT_S:-110}" python3 benchmarks/engine_bench.py \
                decode --shape "$shape" --batch-sizes ${BATCH_SIZES:-1 8} \
                --out "$OUT/decode-$shape-$tag-r$round.json" 2>&1 | grep -v Warn | tail -1
        done
    done
done
OUT=$OUT python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(f"{os.environ['OUT']}/decode-*-r*.json")):
    d = json.load(open(f))
    print(os.path.basename(f), [(r["batch_size"], round(r["step_ms"], 4)) for r in d["results"]])
PY
