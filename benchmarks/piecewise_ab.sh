#!/usr/bin/env bash
# Issue 17 item 1 on one GPU: decode graphs only against decode + piecewise graphs, alternating.
#   bash benchmarks/piecewise_ab.sh     (after run_gpu.sh's set-up: PYTHONPATH, .whl, tokenizer)
# Offline: eager_steps.py (c64-like, 128 x 512/128) and engine_bench.py throughput (nano-vllm
# workload, no transformers); served: atom bench serve at concurrency 1, 16 and 64 (512/128).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
MODES=${MODES:-"full_decode_only full_and_piecewise"}
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
model=$(python3 benchmarks/shapes.py qwen3-0.6b .bench_assets/tokenizer /tmp/qwen3-serve)
for m in $MODES; do
    python3 -m atom_engine.cli.main serve --model "$model" --load-format dummy --port 8011 \
        --max-num-seqs 128 --cudagraph-mode "$m" --uvicorn-log-level warning > "$OUT/serve-$m.log" 2>&1 &
    server=$!
    for _ in $(seq 1 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
    for c in 1 16 64; do
        timeout 120 python3 -m atom_engine.cli.main bench serve --base-url http://127.0.0.1:8011 \
            --tokenizer .bench_assets/tokenizer --num-prompts $(( c == 1 ? 16 : 4 * c )) --max-concurrency $c \
            --random-input-len 512 --random-output-len 128 --ignore-eos --save-result \
            --result-dir "$OUT" --result-filename "serve-c$c-$m.json" 2>&1 | grep -E "throughput|TTFT|TPOT" | head -6
    done
    kill $server; wait $server 2>/dev/null
done
