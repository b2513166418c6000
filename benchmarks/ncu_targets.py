"""Nsight Compute profiles of the kernels behind issue 17's missed kernel targets: what bounds each
(DRAM, the SMs' pipes, latency / stalls, occupancy), read from the hardware counters.

Each case builds its op at the issue's shape (the same inputs as quant_kernels.py /
tune_prefill.py), runs it three times (Triton compiles, caches fill), then once more inside
`cudaProfilerStart/Stop`: `ncu --profile-from-start off` profiles that call's kernels only.

On the device, from the repo root (`benchmarks/ncu_targets.sh` runs every case and summarizes):

    python3 benchmarks/ncu_targets.py --list
    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... --csv \\
        --page raw python3 benchmarks/ncu_targets.py --case mla_decode_bf16 > mla.csv
    python3 benchmarks/ncu_targets.py --summarize DIR --out x.json   # every DIR/<case>.csv

`--clock-control none` leaves the clocks as they are (the device README asks for that), so the
durations are those of a normal run. The summary keeps, per kernel: duration, DRAM bytes and
throughput (% of peak), SM and memory throughput (% of peak), the busiest pipes, achieved
occupancy, registers, and the top warp stall reasons (cycles per issued instruction).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

MLA_BATCH, MLA_CONTEXT, MLA_HEADS = 64, 4096, 128  # issue 17: batch 64, 4K context, 128 heads
GEMM_CASES = {  # case: (projection, M): the block-FP8 GEMM's worst small-M rows (session 9)
    "fp8_gemm_kv_a_m1": ("kv_a_proj_with_mqa", 1),
    "fp8_gemm_q_a_m16": ("q_a_proj", 16),
    "fp8_gemm_o_m16": ("o_proj", 16),
}
_ROW_DEFAULT = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1, k_stages=1,
                   per_sm=8, fill=True, SPLIT_K=None, PERMUTED_K=True, ROW_MMA=True)  # fmt: skip
# case: (INT_SHAPES projection, M, wna16_linear config): the W4A16 decode loops (issue 40), the
# one-row multiply-adds (X_VECTOR, the one-row default) against the packed-unpack dots.
WNA16_CASES = {
    f"w4a16_{proj}_m1_{name}": (proj, 1, config)
    for proj in ("o_proj", "gate_up_proj")
    for name, config in (
        ("x_vector", dict(BLOCK_M=1, SMALL_MAGIC=True, X_VECTOR=True)),  # not the default
        ("packed_dot", dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4,
                            SPLIT_K=None, PERMUTED_K=True, PACKED_DOT=True)),
        ("quad_mma", dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1,
                          k_stages=3, per_sm=4, fill=True, SPLIT_K=None, PERMUTED_K=True,
                          QUAD_MMA=True)),
        ("row_mma", dict(_ROW_DEFAULT, k_stages=2)),
        ("row_mma_k1", _ROW_DEFAULT),  # the one-row default
        ("row_scale_after", dict(_ROW_DEFAULT, ROW_SCALE_AFTER=True)),
        ("row_xsum", dict(_ROW_DEFAULT, ROW_XSUM=True)),
        ("row_ahead4", dict(_ROW_DEFAULT, ROW_STEP=4, ROW_AHEAD=True)),
        ("row_strided", dict(_ROW_DEFAULT, ROW_STRIDED=True)),
        ("row_xsum_ahead2", dict(_ROW_DEFAULT, ROW_STEP=2, ROW_XSUM=True, ROW_AHEAD=True)),
        ("quad_step4", dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1,
                            k_stages=2, per_sm=8, fill=True, SPLIT_K=None, PERMUTED_K=True,
                            QUAD_MMA=True, QUAD_STEP=4)),
    )
}  # fmt: skip
# the fragment layout's decode kernel (int_quant_frag; the weights repacked in the case)
_FRAG = dict(FRAG_LAYOUT=True, num_warps=4, ROWS_PER_WARP=2, per_sm=8, maxnreg=None)
WNA16_CASES.update({
    f"w4a16_{proj}_m1_{name}": (proj, 1, config)
    for proj in ("o_proj", "gate_up_proj")
    for name, config in (
        ("frag", _FRAG),
        ("frag_r56", dict(_FRAG, maxnreg=56)),  # the default launch
        ("frag_unrotated", dict(_FRAG, ROTATE=False)),
    )
})  # fmt: skip
MOE_CASES = {  # case: (MOE_SHAPES name, tokens)
    "moe_mxfp4_gptoss_t1": ("gpt-oss-120b", 1),
    "moe_mxfp4_gptoss_t16": ("gpt-oss-120b", 16),
    "moe_mxfp4_deepseek_t1": ("deepseek-v3", 1),
    "moe_mxfp4_deepseek_t16": ("deepseek-v3", 16),
}


def mla_case(cache_dtype: str) -> Callable[[], object]:
    import torch
    from quant_kernels import MLA_LATENT, MLA_PAGE, MLA_ROPE

    from atom_kernels.backends.triton import mla_attention

    g = torch.Generator(device="cuda").manual_seed(2)
    per_seq = math.ceil(MLA_CONTEXT / MLA_PAGE)
    num_blocks = MLA_BATCH * per_seq
    tables = torch.randperm(num_blocks, device="cuda", generator=g).int().view(MLA_BATCH, per_seq)
    lens = torch.full((MLA_BATCH,), MLA_CONTEXT, dtype=torch.int32, device="cuda")
    qsl = torch.arange(MLA_BATCH + 1, dtype=torch.int32, device="cuda")
    cache = torch.randn(num_blocks, MLA_PAGE, MLA_LATENT + MLA_ROPE, generator=g, device="cuda")
    kv_scale = None
    if cache_dtype == "fp8":
        cache, kv_scale = cache.to(torch.float8_e4m3fn), torch.ones(1, device="cuda")
    else:
        cache = cache.to(torch.bfloat16)
    q = torch.randn(MLA_BATCH, MLA_HEADS, MLA_LATENT + MLA_ROPE, generator=g, device="cuda")
    q = q.to(torch.bfloat16)
    out = torch.empty(MLA_BATCH, MLA_HEADS, MLA_LATENT, dtype=torch.bfloat16, device="cuda")
    scale = (128 + MLA_ROPE) ** -0.5

    def fn():
        return mla_attention.mla_paged_attention(
            q[..., :MLA_LATENT], q[..., MLA_LATENT:], cache, tables, lens, qsl, scale, out,
            kv_scale=kv_scale, max_query_len=1,
        )  # fmt: skip

    return fn


def prefill_case() -> Callable[[], object]:
    from tune_prefill import make_case

    from atom_kernels.backends.triton import attention

    args, _ = make_case((4096, 4096))
    return lambda: attention.paged_attention(*args, None)


def gemm_case(projection: str, rows: int) -> Callable[[], object]:
    import torch
    from quant_kernels import BLOCK, GEMM_SHAPES, cdiv

    from atom_kernels.backends.triton import quant

    n, k = GEMM_SHAPES[projection]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = ((torch.randn(n, k, generator=g, device="cuda") * k**-0.5) * 64).to(torch.float8_e4m3fn)
    w_s = torch.full((cdiv(n, BLOCK[0]), cdiv(k, BLOCK[1])), 1 / 64, device="cuda")
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    x_q, x_s = quant.per_token_group_quant_fp8(x, BLOCK[1])
    block_k = quant.block_k_for(BLOCK[1], False)
    return lambda: quant.w8a8_gemm(
        x_q, x_s, w, w_s, BLOCK[0], BLOCK[1], block_k, None, torch.bfloat16
    )


def wna16_case(projection: str, rows: int, config: dict | None) -> Callable[[], object]:
    import torch
    from quant_kernels import INT_SHAPES, _int_weights

    from atom_kernels.backends.triton import int_quant

    n, k = INT_SHAPES[projection]
    g = torch.Generator(device="cuda").manual_seed(0)
    qweight, scales, _, _ = _int_weights(torch, n, k, g)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    if config and config.get("FRAG_LAYOUT"):
        from atom_kernels.ops.int_quant_frag import wna16_to_frag

        qweight, scales, _ = wna16_to_frag(qweight, scales, None)
        config = {key: v for key, v in config.items() if key != "FRAG_LAYOUT"}
    return lambda: int_quant.wna16_linear(x, qweight, scales, None, None, 4, None, config)


def moe_case(shape: str, tokens: int) -> Callable[[], object]:
    import torch
    from quant_kernels import MOE_SHAPES, _moe_weights

    from atom_kernels.backends.triton import moe

    num_experts, top_k, hidden, inter, _, oai = MOE_SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(1)
    b13 = b2 = None
    if oai:
        b13 = (torch.randn(num_experts, 2 * inter, device="cuda") * 0.02).to(torch.bfloat16)
        b2 = (torch.randn(num_experts, hidden, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, num_experts, generator=g, device="cuda")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    w13, w2, s13, s2 = _moe_weights(torch, num_experts, hidden, inter, "mxfp4", g)
    activation = "swiglu_oai" if oai else "silu"
    args = (x, w13, w2, weights, ids.int(), activation, b13, b2, oai, 1.702, 7.0)
    return lambda: moe.fused_moe(*args, quant="mxfp4", w13_scale=s13, w2_scale=s2)


def cases() -> dict[str, Callable[[], Callable[[], object]]]:
    out = {
        "mla_decode_bf16": lambda: mla_case("bf16"),
        "mla_decode_fp8": lambda: mla_case("fp8"),
        "prefill_attention_4k": prefill_case,
    }
    out.update({name: (lambda a=a: gemm_case(*a)) for name, a in GEMM_CASES.items()})
    out.update({name: (lambda a=a: wna16_case(*a)) for name, a in WNA16_CASES.items()})
    out.update({name: (lambda a=a: moe_case(*a)) for name, a in MOE_CASES.items()})
    return out


def run_case(name: str) -> None:
    import torch

    fn = cases()[name]()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


# --- summary (no torch) -------------------------------------------------------------------------

KEEP = {
    "gpu__time_duration.sum": "duration",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__shared_mem_per_block_dynamic": "dynamic_smem",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issued_inst",
    "sm__inst_executed.avg.per_cycle_active": "ipc",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
PIPE = re.compile(
    r"sm__(?:inst_executed_)?pipe_(\w+?)(?:_cycles_active)?\.avg\.pct_of_peak_sustained_active$"
)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize_csv(path: Path) -> list[dict]:
    """One dict per profiled kernel of an `ncu --csv --page raw` file."""
    lines = [line for line in path.read_text().splitlines() if line.startswith('"')]
    if not lines:
        return []
    rows = list(csv.reader(lines))
    header, units, body = rows[0], rows[1], rows[2:]
    kernels = []
    for row in body:
        values = dict(zip(header, row, strict=False))
        unit = dict(zip(header, units, strict=False))
        k = {"kernel": values.get("Kernel Name", "?")[:120]}
        for metric, key in KEEP.items():
            if metric in values and _number(values[metric]) is not None:
                k[key] = _number(values[metric])
                if unit.get(metric):
                    k[key + "_unit"] = unit[metric]
        stalls, pipes = {}, {}
        for metric, value in values.items():
            number = _number(value)
            if number is None:
                continue
            if m := STALL.match(metric):
                stalls[m.group(1)] = number
            elif m := PIPE.match(metric):
                pipes[m.group(1)] = max(number, pipes.get(m.group(1), 0.0))
        k["top_stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
        k["top_pipes_pct"] = dict(sorted(pipes.items(), key=lambda kv: -kv[1])[:6])
        kernels.append(k)
    return kernels


def summarize(directory: Path) -> dict:
    return {p.stem: summarize_csv(p) for p in sorted(directory.glob("*.csv"))}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the case names")
    parser.add_argument("--case", help="run this case (under ncu)")
    parser.add_argument("--summarize", type=Path, help="a directory of <case>.csv files")
    parser.add_argument("--out", type=Path, help="the summary's JSON")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(cases()))
    elif args.case:
        run_case(args.case)
    elif args.summarize:
        summary = summarize(args.summarize)
        text = json.dumps(summary, indent=1)
        if args.out:
            args.out.write_text(text)
        for case, kernels in summary.items():
            for k in kernels:
                print(
                    f"{case:24} {k['kernel'][:40]:40} {k.get('duration', 0):>9.0f}"
                    f"{k.get('duration_unit', '')} dram {k.get('dram_pct', 0):5.1f}% "
                    f"sm {k.get('sm_pct', 0):5.1f}% occ {k.get('achieved_occupancy_pct', 0):5.1f}% "
                    f"pipes {k['top_pipes_pct']} stalls {list(k['top_stalls'])[:3]}"
                )
    else:
        parser.error("one of --list, --case, --summarize")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
