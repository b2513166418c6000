"""The fused temperature sampler's two kernels, alternating: "gumbel" (noise per token, one pass)
against "block" (noise per block of tokens, then per token inside the drawn block), at Qwen3's
vocabulary, with the time to read the logits once measured in the same run.

Run on a GPU from the repo root:

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python benchmarks/sample_ab.py --out /tmp/o/sample_ab.json

Each case is ``fused_sample(logits, temperature, kernel=...)`` (the Philox keys' draw included)
captured 10 times in a CUDA graph, timed with CUDA events over replays, median, per call:
``warm_us`` back to back (the L2 holds logits under ~50 MB), ``cold_us`` with a 256 MB write
before each call (a graph of the writes alone subtracted). The kernels alternate within each
round. ``read_us`` is torch.amax over the rows (reads the logits once), ``copy_us`` a copy of
them (read + write), both cold; ``copy_GBps`` a 2 GiB device copy. Then a sweep of the block
kernel's tiling (block width, warps, splits) at batch 64-256, cold. Writes JSON as it goes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
from kernels import cold_graph_ms, measure_roofline

from atom_kernels.backends.triton import sampling

VOCAB = 151936  # Qwen3
CALLS = 10


def graph_us(fn, flush: bool, replays: int) -> float:
    """Median GPU time of one ``fn()`` (us) from a CUDA graph of CALLS calls, the L2 flushed
    before each or not (``kernels.cold_graph_ms``)."""
    return cold_graph_ms(fn, CALLS, replays, flush_l2=flush) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip the sweep after")
    args = parser.parse_args()
    began = time.monotonic()
    torch.manual_seed(0)
    flush = True  # graph_us: the L2 flushed before each call
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "default_kernel": sampling.KERNEL,
        "copy_GBps": measure_roofline(torch)["copy_GBps"],
        "cases": [],
        "sweep": [],
    }

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for dtype in (torch.bfloat16, torch.float32):
        for batch in args.batches:
            logits = (torch.randn(batch, VOCAB, device="cuda") * 2.5).to(dtype)
            copy = torch.empty_like(logits)
            read = {
                "read_us": graph_us(lambda lg=logits: torch.amax(lg, -1), flush, args.replays),
                "copy_us": graph_us(lambda lg=logits, c=copy: c.copy_(lg), flush, args.replays),
            }
            for temp in (1.0, 0.6):
                temperature = torch.full((batch,), temp, device="cuda")
                times = {k: {"warm": [], "cold": []} for k in sampling.KERNELS}
                for r in range(args.rounds):
                    order = list(sampling.KERNELS)
                    for kernel in order if r % 2 == 0 else order[::-1]:

                        def fn(kernel=kernel, lg=logits, t=temperature):
                            return sampling.fused_sample(lg, t, kernel=kernel)

                        times[kernel]["warm"].append(graph_us(fn, False, args.replays))
                        times[kernel]["cold"].append(graph_us(fn, flush, args.replays))
                case = {"dtype": str(dtype).split(".")[-1], "batch": batch, "T": temp, **read}
                for kernel, t in times.items():
                    case[f"{kernel}_warm_us"] = statistics.median(t["warm"])
                    case[f"{kernel}_cold_us"] = statistics.median(t["cold"])
                result["cases"].append(case)
                print(json.dumps(case), flush=True)
                save()
            del logits, copy
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (64, 128, 256):
            logits = (torch.randn(batch, VOCAB, device="cuda") * 2.5).to(dtype)
            temperature = torch.ones(batch, device="cuda")
            # (block width, warps): 8 to 16 logits a thread (more spill: 8192 at 8 warps)
            tilings = ((2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))
            for (block_v, num_warps), num_splits in itertools.product(tilings, (1, 2, 4, 8)):
                if time.monotonic() - began > args.budget_s:
                    result["sweep_cut"] = True
                    save()
                    return

                def fn(lg=logits, t=temperature, b=block_v, w=num_warps, s=num_splits):
                    return sampling.fused_sample(
                        lg, t, kernel="block", block_v=b, num_warps=w, num_splits=s
                    )

                row = {
                    "dtype": str(dtype).split(".")[-1], "batch": batch, "block_v": block_v,
                    "num_warps": num_warps, "num_splits": num_splits,
                    "cold_us": graph_us(fn, flush, args.replays),
                }  # fmt: skip
                result["sweep"].append(row)
                print(json.dumps(row), flush=True)
            save()
            del logits
    save()


if __name__ == "__main__":
    main()
