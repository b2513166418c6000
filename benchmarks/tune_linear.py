"""Skinny GEMMs (decode at batch 1-16): the Triton kernel's tiles against cuBLAS (F.linear).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/tune_linear.py --out x.json

Each timing runs one CUDA graph that multiplies x by enough copies of the weight to cover 1.5 GB
(as a decode step walks its layers: every weight comes from HBM, not L2) and reports the time per
GEMM. Llama-3-8B and Qwen3-0.6B projection shapes, bf16. At one row the whole tile grid runs; at
more rows, the best tiles of one row (dot kernels) and cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton

SHAPES = {  # name: (N, K)
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o": (4096, 4096),
    "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
    "llama3-8b lm_head": (128256, 4096),
    "qwen3-0.6b qkv": (4096, 1024),
    "qwen3-0.6b o": (1024, 2048),
    "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072),
    "qwen3-0.6b lm_head": (151936, 1024),
}
ROWS = (1, 4, 8)
# (block_n, block_k, num_warps, num_stages, split_k, prefetch) at one row, multiply-adds: the W
# tile goes to registers (no pipeline), so the bytes in flight are the resident programs times the
# tile (twice that with prefetch: the next tile loaded ahead); narrower or wider tiles and K
# splits change both (Llama-3-8B's qkv / o / down, issue 17).
WIDE_ONE_ROW = [  # most likely first (the tune stops at its budget)
    (16, 512, 4, 1, 1, False),  # the old default (its stages do nothing at one row)
    (4, 1024, 4, 1, 1, False),  # the defaults from K = 4096 and 8192 (results/s12-h100/call1)
    (8, 2048, 8, 1, 1, False),
    (4, 1024, 4, 1, 1, True),
    (8, 2048, 8, 1, 1, True),
    (4, 2048, 4, 1, 1, False),
    (4, 2048, 8, 1, 1, False),
    (4, 4096, 8, 1, 1, False),
    (2, 1024, 4, 1, 1, False),
    (8, 1024, 4, 1, 1, True),
    (16, 512, 4, 1, 1, True),
]
TOTAL_BYTES = 1.5e9


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), rep=200)
    return 2 * src.numel() / ms / 1e6  # GB/s


def main() -> None:
    from atom_kernels.backends.triton import linear

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=200)
    parser.add_argument("--shapes", nargs="*", help="only the shapes whose names start with these")
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument(
        "--wide-one-row",
        action="store_true",
        help="at one row, WIDE_ONE_ROW's tiles (narrow / wide, split-K) instead of the grid",
    )
    args = parser.parse_args()
    start = time.monotonic()
    bandwidth = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = [
        linear.SkinnyConfig(bn, bk, w, s, dot)
        for bn, bk, (w, s), dot in itertools.product(
            (16, 32, 64), (128, 256, 512), ((4, 3), (4, 5), (8, 4)), (True, False)
        )
    ]
    # Few output features (N / 16 < SMs): the split-K kernel, every split count on a smaller grid.
    split_grid = [
        linear.SkinnyConfig(bn, bk, w, s, dot, split)
        for bn, bk, (w, s), dot, split in itertools.product(
            (16, 32), (128, 256, 512), ((4, 3), (4, 5)), (True, False), (1, 2, 4, 8)
        )
    ]
    results = []
    selected = [
        name for name in SHAPES if not args.shapes or any(name.startswith(p) for p in args.shapes)
    ]
    for index, name in enumerate(selected):
        n, k = SHAPES[name]
        # --wide-one-row: each shape its share of the budget (all shapes get timed)
        share = (index + 1) / len(selected) if args.wide_one_row else 1.0
        nbytes = n * k * 2
        copies = max(2, int(TOTAL_BYTES // nbytes))
        g = torch.Generator(device="cuda").manual_seed(0)
        weights = [
            (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
            for _ in range(copies)
        ]
        best_one_row: list[linear.SkinnyConfig] = []
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            expected = torch.nn.functional.linear(x.float(), weights[0].float())

            def timed(fn, x=x, weights=weights):
                return time_per_gemm(fn, x, weights)

            row = dict(shape=name, n=n, k=k, rows=rows, weight_bytes=nbytes)
            row["cublas_us"] = timed(lambda x, w: torch.nn.functional.linear(x, w))
            row["default"] = linear.default_config(rows, n, k, sms, False).__dict__
            row["default_us"] = timed(lambda x, w: linear.skinny_linear(x, w, None))
            if rows == 1 and args.wide_one_row:
                configs = [
                    linear.SkinnyConfig(bn, bk, w, st, False, sp, pf)
                    for bn, bk, w, st, sp, pf in WIDE_ONE_ROW
                ]
            elif rows == 1 and triton.cdiv(n, 16) < sms:
                configs = split_grid
            elif rows == 1:
                configs = grid if name.startswith("llama") or args.shapes else best_of(results, 8)
            else:
                configs = [c for c in best_one_row if c.use_dot]
            tried = []
            for config in configs:
                if time.monotonic() - start > args.budget_s * share:
                    break
                try:
                    out = linear.skinny_linear(x, weights[0], None, config)
                except Exception as e:  # e.g. shared memory: too many stages of a big tile
                    print(f"  {config}: {type(e).__name__}", flush=True)
                    continue
                err = (out.float() - expected).abs().max().item()
                us = timed(lambda x, w, c=config: linear.skinny_linear(x, w, None, c))
                tried.append(dict(config=config.__dict__, us=us, max_err=err))
            tried.sort(key=lambda t: t["us"])
            if rows == 1:
                best_one_row = [linear.SkinnyConfig(**t["config"]) for t in tried[:8]]
            row["tried"] = tried
            best = tried[0]["us"] if tried else row["default_us"]
            row["best_us"] = best
            row["cublas_fraction"] = nbytes / (row["cublas_us"] * 1e3) / bandwidth
            row["default_fraction"] = nbytes / (row["default_us"] * 1e3) / bandwidth
            row["best_fraction"] = nbytes / (best * 1e3) / bandwidth
            results.append(row)
            top = tried[0]["config"] if tried else row["default"]
            print(
                f"{name:20s} rows={rows:2d} cublas {row['cublas_us']:7.1f} us "
                f"({row['cublas_fraction']:.0%}) default {row['default_us']:7.1f} "
                f"({row['default_fraction']:.0%}) best {best:7.1f} ({row['best_fraction']:.0%}) "
                f"{top}",
                flush=True,
            )
        weights.clear()
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(
            {
                "benchmark": "tune_linear",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "copy_GBps": bandwidth,
                "results": results,
            },
            f,
            indent=1,
        )


def time_per_gemm(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per GEMM of one CUDA graph that runs ``fn(x, w)`` for every weight copy."""
    from triton.testing import do_bench_cudagraph

    def run():
        for w in weights:
            fn(x, w)

    return do_bench_cudagraph(run, rep=20) * 1e3 / len(weights)


def best_of(results: list[dict], count: int) -> list:
    """The configs that were fastest at one row over the shapes timed so far (by summed rank)."""
    from atom_kernels.backends.triton import linear

    score: dict[tuple, float] = {}
    for row in results:
        if row["rows"] != 1:
            continue
        for rank, t in enumerate(row["tried"]):
            key = tuple(t["config"].values())
            score[key] = score.get(key, 0) + rank
    ranked = sorted(score, key=score.get)[:count]
    return [linear.SkinnyConfig(*key) for key in ranked]


if __name__ == "__main__":
    main()
