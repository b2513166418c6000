"""The L2 prefetch of a decoder layer's next weights (``ATOM_L2_PREFETCH``, layers/prefetch.py)
on Llama-3-8B's four projections at batch-1 decode, outside the engine: each of LAYERS layers (its
own weights, so L2 holds none of the next) runs a norm's window, the QKV GEMM, a window standing
in for the rotary and attention kernels, the output projection, a norm's window, gate_up and
down; a window is ``torch.cuda._sleep`` (one SM spinning, no DRAM traffic). The prefetch stages
start where the model starts them (``qkv`` before QKV and ``attn`` after it: o_proj and
gate_up; ``mlp`` before gate_up: down; ``next`` before down: the next layer's QKV) and join at
the end. The layers run as one CUDA graph; a row is a plan's median per-layer time over
``--reps`` replays (with that time less the windows alone, and the four GEMMs' weight bytes
over it as a fraction of the copy rate measured in the same call), W4A16 (group 128,
symmetric: ``wna16_linear``) and bf16 (``linear``), the plans alternated inside each round
(every other round reversed).

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
from atom_models.layers import prefetch
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


def build(layers: int, quantized: bool) -> list[dict]:
    """Each layer's projections and its three prefetch stages, chained as LlamaModel does."""
    out = [{name: Proj(n, k, quantized) for name, (n, k) in SHAPES.items()} for _ in range(layers)]
    for i, p in enumerate(out):
        after = [out[i + 1]["qkv"]] if i + 1 < layers else []
        attn = WeightPrefetch("attn", [p["o"], p["gate_up"]])
        early = WeightPrefetch("qkv", attn.modules)
        p["stages"] = (early, attn, WeightPrefetch("mlp", [p["down"]]),
                       WeightPrefetch("next", after))  # fmt: skip
    return out


def step(model: list[dict], x: torch.Tensor, window: int, norm: int) -> torch.Tensor:
    for p in model:
        early, attn, mlp, after = p["stages"]
        torch.cuda._sleep(norm)
        early.start(x)
        qkv = p["qkv"](x)
        attn.start(qkv)
        torch.cuda._sleep(window)
        h = p["o"](x)
        torch.cuda._sleep(norm)
        mlp.start(h)
        g = p["gate_up"](h)
        after.start(g)
        x = p["down"](g[:, : g.shape[-1] // 2])  # the gate half stands in for silu(g) * u
    prefetch.join(x)
    return x


def windows(layers: int, window: int, norm: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            torch.cuda._sleep(norm)
            torch.cuda._sleep(window)
            torch.cuda._sleep(norm)
    return graph


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


PLANS = (
    "", "attn=16", "attn=32", "attn=44", "qkv=32", "qkv=44", "attn=32,last", "mlp=16", "mlp=28",
    "mlp=28,last", "next=12", "attn=32,mlp=20,next=12", "attn=32,mlp=20,next=12,last",
    "qkv=32,mlp=20,next=12,last", "attn=24,mlp=24,next=12,last",
)  # fmt: skip


def copy_gbps() -> float:
    """The copy rate measured here (the roofline of this call): 2 GiB read and written."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def layer_bytes(model: list[dict]) -> int:
    """The bytes one layer's four GEMMs read of their weights (and scales)."""
    return sum(t.numel() * t.element_size() for name in SHAPES for t in model[0][name].buffers())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--plans", nargs="+", default=list(PLANS))
    ap.add_argument("--window-us", type=float, default=8.0)
    ap.add_argument("--norm-us", type=float, default=1.5)
    ap.add_argument("--weights", nargs="+", default=["w4a16", "bf16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "clock_rate", 0) or 1_980_000
    window, norm = (int(us * clock_khz / 1e3) for us in (args.window_us, args.norm_us))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "l2_bytes": getattr(props, "L2_cache_size", None), "layers": args.layers,
              "window_us": args.window_us, "norm_us": args.norm_us, "rows": []}  # fmt: skip
    result["copy_GBps"] = copy = copy_gbps()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for weights in args.weights:
        model = build(args.layers, weights == "w4a16")
        alone = timed(windows(args.layers, window, norm), args.reps) / args.layers
        nbytes = layer_bytes(model)
        graphs = {}
        for spec in args.plans:
            os.environ["ATOM_L2_PREFETCH"] = spec
            step(model, x, window, norm)  # warm-up: tunes, builds the chunk tables
            torch.cuda.synchronize()
            graphs[spec] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[spec]):
                step(model, x, window, norm)
        os.environ.pop("ATOM_L2_PREFETCH", None)
        per = {spec: [] for spec in args.plans}
        for r in range(args.rounds):
            for spec in args.plans if r % 2 == 0 else args.plans[::-1]:
                per[spec].append(timed(graphs[spec], args.reps) / args.layers)
        for spec in args.plans:
            ms = statistics.median(per[spec])
            row = {"weights": weights, "plan": spec, "layer_us": ms * 1e3,
                   "windows_alone_us": alone * 1e3, "layer_less_windows_us": (ms - alone) * 1e3,
                   "rounds_us": [t * 1e3 for t in per[spec]], "weight_bytes": nbytes,
                   # the GEMMs' weight bytes over the layer's time less its windows
                   "of_copy": nbytes / ((ms - alone) * 1e6) / copy}  # fmt: skip
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        del graphs, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
