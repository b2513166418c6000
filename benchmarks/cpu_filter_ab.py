"""Top-k / top-p / min-p masking on the CPU: the torch reference's sort against the sort-free
thresholds (``sampling_threshold``) the CPU ``sample`` takes, alternating, one thread (issue 42).

    uv run python benchmarks/cpu_filter_ab.py --out /tmp/cpu_filter_ab.json

SmolLM2's vocabulary (49,152), logits 8 * N(0, 1); median ms a call over alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from atom_kernels.backends.torch import sampling as reference
from atom_kernels.backends.torch import sampling_threshold

FILTERS = {"k50_p0.9": (50, 0.9, None), "p0.95": (None, 0.95, None), "minp0.1": (None, None, 0.1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "vocab": args.vocab, "rows": []}  # fmt: skip
    for batch in args.batches:
        x = 8 * torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(batch))
        for name, (k, p, m) in FILTERS.items():
            params = tuple(
                None if v is None else torch.full((batch,), v, dtype=dt)
                for v, dt in ((k, torch.int32), (p, torch.float32), (m, torch.float32))
            )
            call = (x, *params)
            fns = {
                "sort_ms": lambda call=call: reference.apply_top_k_top_p_min_p(*call),
                "threshold_ms": lambda call=call: sampling_threshold.apply_top_k_top_p_min_p(*call),
            }
            times = {key: [] for key in fns}
            for r in range(args.rounds):
                for key in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                    start = time.perf_counter()
                    for _ in range(5):
                        fns[key]()
                    times[key].append((time.perf_counter() - start) / 5 * 1e3)
            row = {"batch": batch, "filter": name}
            row.update({key: statistics.median(v) for key, v in times.items()})
            row["speedup"] = row["sort_ms"] / row["threshold_ms"]
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
