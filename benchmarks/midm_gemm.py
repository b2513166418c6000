"""The Qwen3-0.6B projections at the row counts of the nano-vllm workload's large decode steps
(64-256 rows), through `F.linear` (cuBLAS) as the engine runs them: GPU time with a cold L2
(CUDA graph, `kernels.cold_graph_ms`) against the roofline of each GEMM (weights and activations
once over the copy bandwidth, FLOPs over the bf16 matmul rate, both measured in the same run).

    python3 benchmarks/midm_gemm.py --out x.json

`--profile-case NAME:M` runs that one GEMM inside cudaProfilerStart/Stop (for
`ncu --profile-from-start off`), after three warm-up calls. `--triton` also times ATOM's Triton
skinny GEMM with its rows tiled (`skinny_linear`, `SkinnyConfig.block_m`) under each of
TRITON_CONFIGS and split counts, each checked against F.linear first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # Qwen3-0.6B, name: (N out, K in)
    "qkv": (4096, 1024),
    "o": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
}
ROWS = (64, 128, 256)
# (block_m, block_n, block_k, num_warps, num_stages); each with SPLITS
TRITON_CONFIGS = [
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 32, 128, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 64, 64, 8, 4),
    (32, 64, 128, 4, 4),
]
SPLITS = (1, 2, 4)


def triton_rows(torch, x, w, floor_ms: float, name: str) -> list[dict]:
    """The Triton kernel under every TRITON_CONFIGS x SPLITS, checked, then timed."""
    import torch.nn.functional as F
    from kernels import cold_graph_ms

    from atom_kernels.backends.triton.linear import SkinnyConfig, skinny_linear

    expected = F.linear(x.float(), w.float())
    rows = []
    for bm, bn, bk, warps, stages in TRITON_CONFIGS:
        for split in SPLITS:
            config = SkinnyConfig(bn, bk, warps, stages, split_k=split, block_m=bm)
            label = f"{bm}x{bn}x{bk}/{warps}w/{stages}s/split{split}"
            try:
                out = skinny_linear(x, w, None, config)
                error = float((out.float() - expected).abs().max())
                ms = cold_graph_ms(lambda c=config: skinny_linear(x, w, None, c))
            except Exception as e:  # a tile that does not compile: recorded, skipped
                rows.append({"config": label, "error": repr(e)[:300]})
                continue
            rows.append({"config": label, "ms_cold": ms, "max_error": error,
                         "of_roofline": floor_ms / ms})  # fmt: skip
    best = min((r for r in rows if "ms_cold" in r), key=lambda r: r["ms_cold"])
    print(f"{name:8} M={x.shape[0]:4} triton best {best['ms_cold'] * 1e3:6.1f} us "
          f"({best['config']}, err {best['max_error']:.3g})")  # fmt: skip
    return rows


def main() -> int:
    import torch
    import torch.nn.functional as F
    from kernels import cold_graph_ms, measure_roofline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile-case", help="NAME:M, e.g. o:256")
    parser.add_argument("--triton", action="store_true", help="also the Triton tiles")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.profile_case:
        name, m = args.profile_case.split(":")
        n, k = SHAPES[name]
        w = torch.randn(n, k, generator=g, device="cuda").to(torch.bfloat16)
        x = torch.randn(int(m), k, generator=g, device="cuda").to(torch.bfloat16)
        for _ in range(3):
            F.linear(x, w)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        F.linear(x, w)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return 0
    roof = measure_roofline(torch)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g, device="cuda").to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            ms = cold_graph_ms(lambda x=x, w=w: F.linear(x, w))
            nbytes = 2.0 * (n * k + m * k + m * n)
            flops = 2.0 * m * n * k
            floor_ms = max(nbytes / roof["copy_GBps"] / 1e6, flops / roof["matmul_TFLOPs"] / 1e9)
            rows.append({"shape": name, "M": m, "N": n, "K": k, "ms_cold": ms,
                         "roofline_ms": floor_ms, "of_roofline": floor_ms / ms})  # fmt: skip
            if args.triton:
                rows[-1]["triton"] = triton_rows(torch, x, w, floor_ms, name)
            print(f"{name:8} M={m:4} N={n:5} K={k:5} {ms * 1e3:7.1f} us  roofline "
                  f"{floor_ms * 1e3:6.1f} us  {100 * floor_ms / ms:5.1f}%")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"roofline": roof, "rows": rows,
                                        "torch": torch.__version__}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
