"""Sweep the Triton prefill attention configs (tiles, warps, stages, tile order) on a GPU.

Run from the repo root (under 4 minutes on an H100):

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python benchmarks/tune_prefill.py --out $OUT/tune_prefill.json

``--compare``: the default against a few candidates (COMPARE_CONFIGS: other tiles / stages, the
warp-specialized unmasked loop, a 128-register cap) at 4K and 2K causal and 4K over a 6K prefix
(COMPARE_CASES, the three prefill rows of benchmarks/kernels.py), same checks and timings (about
4 minutes).

Case: the "prefill" case of benchmarks/kernels.py (Llama-3-8B heads) at T = 4096 and 2048: one
sequence, causal (its query is the context's last rows: a prefix when the context is longer), 32
query / 8 kv heads, head dim 128, bf16, pages of 16 tokens in shuffled order.
Each config is compiled first in parallel worker processes (Triton's disk cache then serves the
timing process; a config that fails to compile or launch, e.g. out of shared memory, is reported
and skipped), then run once per T and checked against the torch reference backend (max abs
error; over TOLERANCE or not finite is flagged BAD), then timed as the whole op
(``paged_attention``: the prefill kernel and the decode launch whose programs exit at once) with
``do_bench_cudagraph`` (GPU time, warm L2). The fastest configs, the default and torch SDPA (flash
over dense, unpaged K/V) are timed again with the L2 flushed before each call (``ms_cold``, as
benchmarks/kernels.py reports). TFLOP/s count the causal pairs (kernels.attention_flops).
Writes JSON to --out and prints the sorted table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from dataclasses import replace

from kernels import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    _paged,
    attention_flops,
    cold_graph_ms,
)

# (context length, query length) of one sequence
CASES = [(4096, 4096), (2048, 2048)]
COMPARE_CASES = [(4096, 4096), (2048, 2048), (4096 + 6144, 4096)]
TOLERANCE = 2e-2  # bf16 outputs of O(1): the tests' 1.6e-2 plus margin for T = 4096 sums
# (block_m, block_n, num_warps, num_stages, heavy_first)
CONFIGS = [
    (128, 64, 8, 2, True),
    (128, 64, 8, 3, True),
    (128, 64, 8, 4, True),
    (128, 64, 4, 2, True),
    (128, 64, 4, 3, True),
    (128, 128, 8, 1, True),
    (128, 128, 8, 2, True),
    (128, 128, 8, 3, True),
    (128, 128, 4, 2, True),
    (128, 32, 8, 3, True),
    (128, 32, 8, 4, True),
    (128, 32, 4, 3, True),
    (64, 64, 4, 2, True),
    (64, 64, 4, 3, True),
    (64, 64, 4, 4, True),
    (64, 64, 8, 3, True),
    (64, 128, 4, 2, True),
    (64, 128, 4, 3, True),
    (64, 128, 8, 2, True),
    (64, 32, 4, 3, True),
    (64, 32, 4, 4, True),
    (256, 32, 8, 2, True),
    (256, 64, 8, 2, True),
    # the tile order switch: light tiles first, as before the rewrite
    (128, 64, 8, 3, False),
    (128, 128, 8, 2, False),
    (64, 64, 4, 3, False),
]
# --compare: (block_m, block_n, num_warps, num_stages, heavy_first[, warp_specialize[, maxnreg]])
# 128x32 at 8 warps and 128 registers: two programs an SM (attention.default_config's NOTE).
COMPARE_CONFIGS = [
    (128, 128, 8, 2, True),
    (128, 128, 8, 2, True, True),
    (128, 64, 8, 3, True),
    (128, 64, 8, 3, True, True),
    (128, 32, 4, 3, True),
    (128, 32, 4, 2, True),
    (128, 32, 8, 3, True),
    (128, 32, 8, 3, True, False, 128),
    (128, 32, 8, 4, True, False, 128),
    (128, 32, 8, 2, True, False, 128),
    (128, 64, 8, 2, True, False, 128),
    (64, 64, 4, 3, True),
]
COLD_TOP = 4  # configs re-timed with a cold L2 (plus the default)


def normalize(config: tuple) -> tuple:
    """(block_m, block_n, warps, stages, heavy_first, warp_specialize, maxnreg); a shorter tuple
    has no warp specialization and no register cap (None)."""
    return (*config, *(False, None)[len(config) - 5 :])


def name(config: tuple) -> str:
    block_m, block_n, warps, stages, heavy_first, ws, maxnreg = normalize(config)
    order = "" if heavy_first else " fwd"
    extra = (" ws" if ws else "") + (f" r{maxnreg}" if maxnreg else "")
    return f"{block_m}x{block_n} w{warps} s{stages}{order}{extra}"


def case_name(case: tuple) -> str:
    seq_len, q_len = case
    return f"T={q_len}" + (f"+{seq_len - q_len}" if seq_len > q_len else "")


def attention_config(default, config: tuple):
    block_m, block_n, warps, stages, heavy_first, ws, maxnreg = normalize(config)
    return replace(
        default,
        prefill_block_m=block_m,
        prefill_block_n=block_n,
        prefill_num_warps=warps,
        prefill_num_stages=stages,
        prefill_heavy_first=heavy_first,
        prefill_warp_specialize=ws,
        prefill_maxnreg=maxnreg,
    )


def make_case(case: tuple):
    """(the op's positional args without out, FLOPs) of one sequence of ``case`` (context
    length, query length)."""
    import torch

    seq_len, q_len = case
    query, kc, vc, bt, sl, qsl = _paged(torch, [seq_len], [q_len], torch.bfloat16)
    args = (query, kc, vc, bt, sl, qsl, 1 / math.sqrt(HEAD_DIM), None, None, None, None, None)
    return args, attention_flops([q_len], [seq_len], NUM_HEADS, HEAD_DIM, HEAD_DIM)


# --- compile workers ------------------------------------------------------------------------

_worker_args = None


def _worker_init() -> None:
    global _worker_args
    import torch

    torch.manual_seed(0)
    _worker_args, _ = make_case(min(CASES))  # same specialization as every case swept


def _compile(config: tuple) -> tuple[tuple, str | None]:
    import torch

    from atom_kernels.backends.triton import attention

    default = attention.default_config(HEAD_DIM, torch.bfloat16, False, NUM_HEADS // NUM_KV_HEADS)
    try:
        attention.paged_attention(*_worker_args, None, config=attention_config(default, config))
        torch.cuda.synchronize()
    except Exception as e:  # out of shared memory / registers, compiler errors: reported later
        return config, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return config, None


def precompile(configs: list[tuple], jobs: int) -> dict[tuple, str]:
    """Compile every config, at most ``jobs`` at a time, each in a process of its own: a compiler
    crash (an assert in a pass aborts the process) fails that config only, where a shared pool
    would hang or break. {config: error} of those that failed."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    errors = {}
    context = multiprocessing.get_context("spawn")
    for first in range(0, len(configs), jobs):
        batch = configs[first : first + jobs]
        pools = [ProcessPoolExecutor(1, context, initializer=_worker_init) for _ in batch]
        futures = [pool.submit(_compile, config) for pool, config in zip(pools, batch, strict=True)]
        for pool, config, future in zip(pools, batch, futures, strict=True):
            try:
                _, error = future.result()
            except BrokenProcessPool:
                error = "the compile process died (a compiler crash, or its setup failed)"
            if error:
                errors[config] = error
            pool.shutdown()
    return errors


# --- main -----------------------------------------------------------------------------------


def sdpa_fn(torch, tokens: int):
    """torch SDPA on the same case over dense K/V: (fn, label). Flash with GQA if this torch
    has it, else flash over K/V expanded to every query head, else whatever SDPA picks."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, NUM_HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, NUM_KV_HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    group = NUM_HEADS // NUM_KV_HEADS
    k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def expanded():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True)

    for fn, label in ((gqa, "flash gqa"), (expanded, "flash kv expanded")):
        try:
            fn()
            torch.cuda.synchronize()
            return fn, label
        except RuntimeError:
            continue
    return (lambda: F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True)), "default"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--jobs", type=int, default=8, help="compile processes (0: compile inline)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated configs BMxBNxWxS[xfwd][xws][xr<maxnreg>], e.g. 128x32x8x3xr128",
    )
    parser.add_argument("--rep", type=int, default=30, help="do_bench_cudagraph rep (ms)")
    parser.add_argument(
        "--compare", action="store_true", help="COMPARE_CONFIGS over COMPARE_CASES (see above)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()

    import torch
    import triton
    from triton.testing import do_bench_cudagraph

    from atom_kernels.backends.torch import attention as reference
    from atom_kernels.backends.triton import attention

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/tune_prefill.py needs a CUDA GPU")
    configs = [normalize(c) for c in (COMPARE_CONFIGS if args.compare else CONFIGS)]
    cases = COMPARE_CASES if args.compare else CASES
    if args.only:
        configs = []
        for spec in args.only.split(","):  # BMxBNxWxS[xfwd][xws][xr<maxnreg>]
            parts = spec.split("x")
            regs = [int(p[1:]) for p in parts[4:] if p.startswith("r")]
            configs.append((
                *map(int, parts[:4]), "fwd" not in parts[4:], "ws" in parts[4:],
                regs[0] if regs else None,
            ))  # fmt: skip
    default = attention.default_config(HEAD_DIM, torch.bfloat16, False, NUM_HEADS // NUM_KV_HEADS)
    default_key = (
        default.prefill_block_m, default.prefill_block_n, default.prefill_num_warps,
        default.prefill_num_stages, default.prefill_heavy_first, default.prefill_warp_specialize,
        default.prefill_maxnreg,
    )  # fmt: skip
    if default_key not in configs:
        configs = [default_key, *configs]

    errors = precompile(configs, args.jobs) if args.jobs > 0 else {}
    print(f"compiled {len(configs)} configs in {time.perf_counter() - started:.0f} s", flush=True)
    for config, error in errors.items():
        print(f"  {name(config)}: {error}", flush=True)

    torch.manual_seed(0)
    rows, made = [], {}
    for case in cases:
        label = case_name(case)
        op_args, flops = make_case(case)
        expected = reference.paged_attention(*op_args, None).float()
        made[case] = (op_args, flops)
        for config in configs:
            row = {
                "T": label,
                "config": name(config),
                "params": config,
                "default": config == default_key,
                # False where this Triton lacks tl.range(warp_specialize=...): the plain loop ran
                "warp_specialized": attention.prefill_warp_specialize(
                    attention_config(default, config), torch.bfloat16, False
                ),
            }
            rows.append(row)
            if config in errors:  # failed to compile or launch in a worker: not retried
                row["ok"], row["error"] = False, errors[config]
                print(f"{label} {name(config):>21}: {row['error']}  BAD", flush=True)
                continue
            cfg = attention_config(default, config)

            def fn(cfg=cfg, op_args=op_args):
                return attention.paged_attention(*op_args, None, config=cfg)

            try:
                out = fn().float()
                error = (out - expected).abs().max().item()
                row["max_abs_err"] = error
                row["ok"] = math.isfinite(error) and error <= TOLERANCE
                ms = float(do_bench_cudagraph(fn, rep=args.rep, return_mode="median"))
                row["ms"] = ms
                row["tflops"] = flops / (ms / 1e3) / 1e12
            except Exception as e:  # compile / launch failures: flagged, the sweep goes on
                row["ok"] = False
                row["error"] = errors.get(config) or f"{type(e).__name__}: {e}"[:200]
            print(
                f"{label} {name(config):>21}: "
                + (f"{row['tflops']:6.1f} TFLOP/s  err {row['max_abs_err']:.2e}"
                   if "tflops" in row else row.get("error", "failed"))
                + ("" if row["ok"] else "  BAD"),
                flush=True,
            )  # fmt: skip
        del expected

    # Cold-L2 times for the best configs, the default and SDPA, as benchmarks/kernels.py reports.
    cold = []
    for case in cases:
        label = case_name(case)
        op_args, flops = made[case]
        ranked = sorted(
            (r for r in rows if r["T"] == label and r["ok"] and "ms" in r), key=lambda r: r["ms"]
        )
        picked = ranked[:COLD_TOP] + [r for r in ranked[COLD_TOP:] if r["default"]]
        for row in picked:
            cfg = attention_config(default, tuple(row["params"]))
            ms = cold_graph_ms(lambda cfg=cfg, op_args=op_args: attention.paged_attention(
                *op_args, None, config=cfg))  # fmt: skip
            row["ms_cold"] = ms
            row["tflops_cold"] = flops / (ms / 1e3) / 1e12
        if case[0] != case[1]:  # a prefix: sdpa_fn is square causal only
            continue
        fn, sdpa_label = sdpa_fn(torch, case[1])
        ms = float(do_bench_cudagraph(fn, rep=args.rep, return_mode="median"))
        ms_cold = cold_graph_ms(fn)
        cold.append({
            "T": label, "impl": f"torch SDPA {sdpa_label}", "ms": ms, "ms_cold": ms_cold,
            "tflops": flops / (ms / 1e3) / 1e12, "tflops_cold": flops / (ms_cold / 1e3) / 1e12,
        })  # fmt: skip

    report = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "case": f"B=1 causal, H={NUM_HEADS} Hk={NUM_KV_HEADS} D={HEAD_DIM} bf16, "
        f"block size {BLOCK_SIZE}; {', '.join(map(case_name, cases))} (T=q+prefix)",
        "timing": f"do_bench_cudagraph rep={args.rep} ms median (warm L2); ms_cold: L2 flushed",
        "seconds": time.perf_counter() - started,
        "configs": rows,
        "sdpa": cold,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2, default=str)

    print(f"\n{report['device']}  torch {torch.__version__}  triton {triton.__version__}")
    for case in cases:
        label = case_name(case)
        print(f"\n{label:<12} config              TFLOP/s  cold   max err")
        ranked = sorted(
            (r for r in rows if r["T"] == label),
            key=lambda r: -r.get("tflops", -1.0),
        )
        for r in ranked:
            if "tflops" not in r:
                print(f"  {r['config']:>24}   failed: {r.get('error', '')[:60]}")
                continue
            cold_rate = f"{r['tflops_cold']:6.1f}" if "tflops_cold" in r else "     -"
            flag = "" if r["ok"] else "  BAD"
            mark = "  (default)" if r["default"] else ""
            print(
                f"  {r['config']:>24}   {r['tflops']:6.1f}  {cold_rate}  "
                f"{r['max_abs_err']:.1e}{flag}{mark}"
            )
        for s in cold:
            if s["T"] == label:
                print(f"  {s['impl']:>24}   {s['tflops']:6.1f}  {s['tflops_cold']:6.1f}")
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
