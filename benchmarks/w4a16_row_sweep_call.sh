#!/usr/bin/env bash
# Issue 40 item 4, one device call (one H100 / H200): the one-row W4A16 GEMMs at the Llama-3-8B
# projections, cold L2, every row checked against the reference (quant_kernels.py --only int
# --int-rows 1): the default tile (8 rows, 4 warps), its occupancy tiles (4 rows a warp, a
# 56-register cap, K = 4096 split in two) and the scale-after tiles beside bf16 `linear`, then
# a table of every row. Under $OUT (carry [".whl"]):
#   int-row-sweep.json, ncu/summary.json
#   bash benchmarks/w4a16_row_sweep_call.sh   (session 34's second call ran it at commit 371cfed
#   with the L2-prefetch tiles and ncu cases too; the prefetch is gone since)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export OUT
mkdir -p "$OUT"
. benchmarks/device_env.sh
timeout ${SWEEP_S:-200} python3 benchmarks/quant_kernels.py --only int --int-rows 1 \
    --int-impls "row-mma 8 w4 k1 fill8,occupancy,scale-after,bf16_linear" \
    --out "$OUT/int-row-sweep.json" 2>&1 | grep -v Warn | tail -3
OUT=$OUT python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/int-row-sweep.json"))
for r in d["results"]:
    print(f"{r['shape'][:22]:22s} {r['impl'][:58]:58s} cold {r['ms_cold'] * 1e3:6.2f} us "
          f"graph {r['ms_graph'] * 1e3:6.2f} us {r['of_roofline']:.0%}{' BAD' if r['bad'] else ''}")
PY
# Nsight Compute of the default and the scale-after launches (gate_up, o_proj):
# ncu/summary.json (stalls, occupancy, DRAM and issue rates)
[ "${NCU_CASES:-1}" = 0 ] || bash benchmarks/ncu_targets.sh "$OUT/ncu" \
    w4a16_gate_up_proj_m1_row_mma_k1 w4a16_gate_up_proj_m1_row_scale_after \
    w4a16_o_proj_m1_row_mma_k1 w4a16_o_proj_m1_row_scale_after 2>&1 | tail -8
rm -f "$OUT"/ncu/*.csv  # the summary holds what they say (at most 8 files come back)
