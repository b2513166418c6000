"""The fused gate/up GEMM + SiLU-and-mul kernel's tiles against cuBLAS then ``silu_and_mul``.

    python benchmarks/tune_gated_linear.py --out x.json   # PYTHONPATH: packages/*/src

What a gated MLP's first half costs at batch-1..8 decode, both ways, timed as tune_linear.py
times a GEMM (one CUDA graph over 1.5 GB of weight copies: every weight comes from HBM): the
unfused pair (F.linear, then the Triton ``silu_and_mul``: two launches) and the fused kernel over
a grid of tiles (one launch). Qwen3-0.6B and Llama-3-8B gate_up shapes, bf16.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tune_linear import TOTAL_BYTES, copy_bandwidth, time_per_gemm  # noqa: E402

SHAPES = {  # name: (2N, K), the packed gate_up weight
    "qwen3-0.6b gate_up": (6144, 1024),
    "llama3-8b gate_up": (28672, 4096),
}
ROWS = (1, 4, 8)


def main() -> None:
    from atom_kernels.backends.triton import activation, gated_linear
    from atom_kernels.backends.triton.linear import SkinnyConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=150)
    args = parser.parse_args()
    start = time.monotonic()
    bandwidth = copy_bandwidth()
    one_row = [
        SkinnyConfig(bn, bk, w, s, False)
        for bn, bk, (w, s) in itertools.product((4, 8, 16), (128, 256, 512), ((4, 3), (4, 4)))
    ]
    dots = [
        SkinnyConfig(bn, bk, w, s)
        for bn, bk, (w, s) in itertools.product((16, 32), (128, 256), ((4, 3), (4, 4)))
    ]
    results = []
    for name, (n2, k) in SHAPES.items():
        nbytes = n2 * k * 2
        copies = max(2, int(TOTAL_BYTES // nbytes))
        g = torch.Generator(device="cuda").manual_seed(0)
        weights = [
            (torch.randn(n2, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
            for _ in range(copies)
        ]
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            gate, up = torch.nn.functional.linear(x, weights[0]).float().chunk(2, dim=-1)
            expected = torch.nn.functional.silu(gate) * up
            row = dict(shape=name, n2=n2, k=k, rows=rows, weight_bytes=nbytes)
            row["unfused_us"] = time_per_gemm(
                lambda x, w: activation.silu_and_mul(torch.nn.functional.linear(x, w)), x, weights
            )
            row["default"] = gated_linear.default_config(rows, False, True, k).__dict__
            row["default_us"] = time_per_gemm(
                lambda x, w: gated_linear.gated_skinny_linear(x, w, None), x, weights
            )
            tried = []
            for config in one_row if rows == 1 else dots:
                if time.monotonic() - start > args.budget_s:
                    break
                try:
                    out = gated_linear.gated_skinny_linear(x, weights[0], None, config)
                except Exception as e:  # e.g. shared memory: too many stages of a big tile
                    print(f"  {config}: {type(e).__name__}", flush=True)
                    continue
                err = (out.float() - expected).abs().max().item()
                us = time_per_gemm(
                    lambda x, w, c=config: gated_linear.gated_skinny_linear(x, w, None, c),
                    x,
                    weights,
                )
                tried.append(dict(config=config.__dict__, us=us, max_err=err))
            tried.sort(key=lambda t: t["us"])
            row["tried"] = tried
            row["best_us"] = tried[0]["us"] if tried else row["default_us"]
            row["unfused_fraction"] = nbytes / (row["unfused_us"] * 1e3) / bandwidth
            row["best_fraction"] = nbytes / (row["best_us"] * 1e3) / bandwidth
            results.append(row)
            top = tried[0]["config"] if tried else row["default"]
            print(
                f"{name:20s} rows={rows} unfused {row['unfused_us']:6.1f} us "
                f"({row['unfused_fraction']:.0%}) fused default {row['default_us']:6.1f} "
                f"best {row['best_us']:6.1f} ({row['best_fraction']:.0%}) {top}",
                flush=True,
            )
        weights.clear()
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(
            {
                "benchmark": "tune_gated_linear",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "copy_GBps": bandwidth,
                "results": results,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
