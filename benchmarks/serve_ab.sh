#!/usr/bin/env bash
# atom serve under `atom bench serve` (Qwen3-0.6B shape, dummy weights, 512 in / 128 out, 4 x c
# requests; 16 at c = 1), cudagraph modes alternating over rounds, on one GPU:
#   MODES="full_and_piecewise full" ROUNDS=2 bash benchmarks/serve_ab.sh
# (carry .whl and .bench_assets: README). Results: $OUT/serve-c<c>-<mode>-r<round>.json
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh  # wheels, PYTHONPATH, the tests' tokenizer
OUT=${OUT:-$PWD/gpu-out}
MODES=${MODES:-"full_and_piecewise full"}
ROUNDS=${ROUNDS:-2}
CONCURRENCY=${CONCURRENCY:-"1 16 64"}
mkdir -p "$OUT"
model=$(python3 benchmarks/shapes.py qwen3-0.6b .bench_assets/tokenizer /tmp/qwen3-serve)
for r in $(seq 0 $((ROUNDS - 1))); do
    modes=$MODES
    if [ $((r % 2)) = 1 ]; then modes=$(echo $MODES | tr ' ' '\n' | tac | tr '\n' ' '); fi
    for m in $modes; do
        python3 -m atom_engine.cli.main serve --model "$model" --load-format dummy --port 8011 \
            --max-num-seqs 128 --cudagraph-mode "$m" --uvicorn-log-level warning > "$OUT/serve-$m-r$r.log" 2>&1 &
        server=$!
        for _ in $(seq 1 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
        for c in $CONCURRENCY; do
            timeout 120 python3 -m atom_engine.cli.main bench serve --base-url http://127.0.0.1:8011 \
                --tokenizer .bench_assets/tokenizer --num-prompts $(( c == 1 ? 16 : 4 * c )) --max-concurrency $c \
                --random-input-len 512 --random-output-len 128 --ignore-eos --save-result \
                --result-dir "$OUT" --result-filename "serve-c$c-$m-r$r.json" 2>&1 \
                | grep -E "Output token throughput|Mean TTFT" | tr -s ' ' | tr '\n' ' '
            echo "<- $m c$c round $r"
        done
        kill $server; wait $server 2>/dev/null
    done
done
