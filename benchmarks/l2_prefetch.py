"""The L2 prefetch of a decoder layer's weights (``ATOM_L2_PREFETCH_MB``, layers/prefetch.py) on
Llama-3-8B's four projections at batch-1 decode, outside the engine: each of LAYERS layers (its
own weights, so L2 holds none of the next) runs the QKV GEMM, a window standing in for the
rotary and attention kernels (``torch.cuda._sleep``: one SM spinning, no DRAM traffic), then the
output projection, gate_up and down; with a budget, ``WeightPrefetch`` forks the prefetch of
o_proj and gate_up (its leading part) as the window starts and joins before o_proj. The layers
run as one CUDA graph; a row is the median per-layer time (and that time less the window alone)
over ``--reps`` replays, W4A16 (group 128, symmetric: ``wna16_linear``) and bf16 (``linear``),
the budgets alternated inside each round.

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python benchmarks/l2_prefetch.py --out $OUT/l2-prefetch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from torch import nn

import atom_kernels
from atom_models.layers.prefetch import WeightPrefetch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


class Proj(nn.Module):
    """One projection's tensors as buffers (what WeightPrefetch reads) and its GEMM."""

    def __init__(self, n: int, k: int, quantized: bool) -> None:
        super().__init__()
        self.quantized = quantized
        if quantized:
            self.register_buffer("qweight", torch.randint(-(2**31), 2**31 - 1, (n, k // 8),
                                 dtype=torch.int32, device="cuda"))  # fmt: skip
            self.register_buffer("scales", torch.rand(n, k // 128, device="cuda",
                                 dtype=torch.bfloat16) * 1e-3)  # fmt: skip
        else:
            self.register_buffer("weight", torch.randn(n, k, device="cuda",
                                 dtype=torch.bfloat16) * 1e-2)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return atom_kernels.wna16_linear(x, self.qweight, self.scales, None, None, 4)
        return atom_kernels.linear(x, self.weight)


def build(layers: int, quantized: bool):
    out = []
    for _ in range(layers):
        p = {name: Proj(n, k, quantized) for name, (n, k) in SHAPES.items()}
        out.append((p, WeightPrefetch([p["o"], p["gate_up"]])))
    return out


def step(model, x: torch.Tensor, window_cycles: int) -> torch.Tensor:
    for p, prefetch in model:
        p["qkv"](x)
        prefetch.start(x)
        if window_cycles:
            torch.cuda._sleep(window_cycles)
        prefetch.join()
        h = p["o"](x)
        g = p["gate_up"](h)
        x = p["down"](g[:, :14336])
    return x


def timed(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 8, 16, 24, 32, 40, 48])
    ap.add_argument("--windows-us", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    clock_khz = torch.cuda.get_device_properties(0).clock_rate if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1_980_000  # fmt: skip
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size,
              "layers": args.layers, "rows": []}  # fmt: skip
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for quantized in (True, False):
        model = build(args.layers, quantized)
        for window in args.windows_us:
            cycles = int(window * clock_khz / 1e3)
            alone = torch.cuda.CUDAGraph()  # the windows alone
            with torch.cuda.graph(alone):
                for _ in range(args.layers):
                    torch.cuda._sleep(cycles)
            window_ms = timed(alone, args.reps) / args.layers
            graphs = {}
            for budget in args.budgets:
                os.environ["ATOM_L2_PREFETCH_MB"] = str(budget)
                step(model, x, cycles)  # warm-up: tunes, builds the chunk tables
                torch.cuda.synchronize()
                graphs[budget] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[budget]):
                    step(model, x, cycles)
            per = {b: [] for b in args.budgets}
            for r in range(args.rounds):
                order = args.budgets if r % 2 == 0 else args.budgets[::-1]
                for budget in order:
                    per[budget].append(timed(graphs[budget], args.reps) / args.layers)
            for budget in args.budgets:
                ms = statistics.median(per[budget])
                row = {"weights": "w4a16" if quantized else "bf16", "window_us": window,
                       "window_alone_us": window_ms * 1e3, "budget_mb": budget,
                       "layer_us": ms * 1e3, "layer_less_window_us": (ms - window_ms) * 1e3,
                       "rounds_us": [t * 1e3 for t in per[budget]]}  # fmt: skip
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            json.dump(result, open(args.out, "w"), indent=1)
            del graphs
        del model
        torch.cuda.empty_cache()
    os.environ.pop("ATOM_L2_PREFETCH_MB", None)


if __name__ == "__main__":
    main()
