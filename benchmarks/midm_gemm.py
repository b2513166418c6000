"""The Qwen3-0.6B projections at the row counts of the nano-vllm workload's large decode steps
(64-256 rows), through `F.linear` (cuBLAS) as the engine runs them: GPU time with a cold L2
(CUDA graph, `kernels.cold_graph_ms`) against the roofline of each GEMM (weights and activations
once over the copy bandwidth, FLOPs over the bf16 matmul rate, both measured in the same run).

    python3 benchmarks/midm_gemm.py --out x.json

`--profile-case NAME:M` runs that one GEMM inside cudaProfilerStart/Stop (for
`ncu --profile-from-start off`), after three warm-up calls.
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


def main() -> int:
    import torch
    import torch.nn.functional as F
    from kernels import cold_graph_ms, measure_roofline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile-case", help="NAME:M, e.g. o:256")
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
            print(f"{name:8} M={m:4} N={n:5} K={k:5} {ms * 1e3:7.1f} us  roofline "
                  f"{floor_ms * 1e3:6.1f} us  {100 * floor_ms / ms:5.1f}%")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"roofline": roof, "rows": rows,
                                        "torch": torch.__version__}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
