"""Filtered sampling (top-k / top-p / min-p) on the GPU: the reference's sort against the Triton
kernel (``sampling_filter``), alternating (issue 42, item 2).

Run on a GPU from the repo root:

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python benchmarks/sample_filter_ab.py --out /tmp/o/sample_filter_ab.json

Each case runs each route, rotating their order each round: the torch reference (sort-based
masking, exponential race), ``sampling_filter``'s kernel (one program a row) at each ``--ways``
(pivots a pass) and ``--tops`` (the largest logits its first pass keeps; 0: every threshold
searched, the kernel before session 26) and ``--prunes`` (1: the work a block cannot change
skipped, 0: the kernel before session 27), and ``sampling_filter_split``'s (a row over programs)
at each ``--split-ways``.
(Session 21's results also have a third route, torch thresholds then the fused draw, since
dropped on the GPU.) The reference syncs the host inside (the filters' checks), so a call is
timed on the wall clock from a synced GPU to a synced GPU: median over ``--rounds`` of ``--calls``
calls each, ms a call.
Logits: ``flat`` is 4 * N(0, 1) (a top-p nucleus of tens of thousands of tokens), ``peaked``
8 * N(0, 1) (a nucleus of a few dozen, like a model's). Writes JSON as it goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from atom_kernels.backends.torch import sampling as reference
from atom_kernels.backends.triton import sampling_filter, sampling_filter_split

FILTERS = {  # name -> (top_k, top_p, min_p)
    "k50_p0.9": (50, 0.9, None),
    "p0.95": (None, 0.95, None),
    "minp0.1": (None, None, 0.1),
}


def old_route(logits, temperature, top_k, top_p, min_p):
    return reference.sample(logits, temperature, top_k, top_p, min_p, None, 0)


def kernel_route(logits, temperature, top_k, top_p, min_p, ways, top=None, prune=None):
    return sampling_filter.filtered_sample(
        logits, temperature, top_k, top_p, min_p, ways=ways, top=top, prune=prune
    )


def split_route(logits, temperature, top_k, top_p, min_p, ways):
    return sampling_filter_split.filtered_sample(
        logits, temperature, top_k, top_p, min_p, ways=ways
    )


def wall_ms(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[128256, 151936])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ways", type=int, nargs="+", default=[4])
    parser.add_argument("--split-ways", type=int, nargs="+", default=[8, 16])
    parser.add_argument(
        "--tops", type=int, nargs="+", default=[sampling_filter.TOP],
        help="the one-program kernel's kept top logits (0: every threshold searched)",
    )  # fmt: skip
    parser.add_argument(
        "--prunes", type=int, nargs="+", default=[int(sampling_filter.PRUNE)],
        help="the one-program kernel's PRUNE (1: on, 0: off)",
    )  # fmt: skip
    parser.add_argument("--filters", nargs="+", default=list(FILTERS), choices=list(FILTERS))
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": [],
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    for vocab in args.vocabs:
        for batch in args.batches:
            for spread, shape in ((4.0, "flat"), (8.0, "peaked")):
                logits = spread * torch.randn(batch, vocab, device="cuda", generator=gen)
                temperature = torch.full((batch,), 0.8, device="cuda")
                for name in args.filters:
                    k, p, m = FILTERS[name]
                    params = tuple(
                        None if v is None else torch.full((batch,), v, dtype=dt, device="cuda")
                        for v, dt in ((k, torch.int32), (p, torch.float32), (m, torch.float32))
                    )
                    call = (logits, temperature, *params)
                    fns = {
                        "sort_ms": lambda call=call: old_route(*call),
                        **{
                            f"kernel_w{w}_t{t}_p{q}_ms": (
                                lambda call=call, w=w, t=t, q=q: kernel_route(*call, w, t, bool(q))
                            )
                            for w in args.ways
                            for t in args.tops
                            for q in args.prunes
                        },
                        **{
                            f"split_w{w}_ms": lambda call=call, w=w: split_route(*call, w)
                            for w in args.split_ways
                        },
                    }
                    for fn in fns.values():
                        fn()  # compile / warm
                    times = {key: [] for key in fns}
                    for r in range(args.rounds):
                        order = list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]
                        for key in order:
                            times[key].append(wall_ms(fns[key], args.calls))
                    row = {"vocab": vocab, "batch": batch, "logits": shape, "filter": name}
                    row.update({key: statistics.median(v) for key, v in times.items()})
                    prefixes = ("kernel_w", "split_w")
                    kernels = {k: v for k, v in row.items() if k.startswith(prefixes)}
                    row["best_kernel"] = min(kernels, key=kernels.get)
                    row["kernel_speedup"] = row["sort_ms"] / kernels[row["best_kernel"]]
                    print(json.dumps(row), flush=True)
                    result["rows"].append(row)
                    with open(args.out, "w") as f:
                        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
