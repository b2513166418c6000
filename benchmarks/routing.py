"""MoE routing on one GPU: the torch reference ops against the Triton kernels (issue 37).

    python benchmarks/routing.py --out $OUT/routing.json
    python benchmarks/routing.py --smoke --out /tmp/routing.json   # CPU: the check only, no timing

For each routed model's router (Qwen3-235B-A22B: softmax top-8 of 128; DeepSeek-V3: sigmoid +
bias, 8 groups, top-4 groups, top-8 of 256; Kimi-K2: sigmoid + bias, top-8 of 384; GPT-OSS:
top-4 then softmax of 128) and token counts 1 / 8 / 64 / 512, distinct bf16 logits: the Triton
result is first checked against the reference (the same ids, weights within 1e-5), then both are
timed inside a CUDA graph of 20 back-to-back calls, replayed, alternating round by round (median
of the rounds). A decode step runs one routing a MoE layer: the difference times the layers
(94 for Qwen3-235B, 58 MoE layers for DeepSeek-V3 and Kimi-K2's 60) is what a step saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from allreduce import CALLS, _graph, _time_us  # noqa: E402  (graphs of CALLS calls, timed)

TOKENS = (1, 8, 64, 512)
# name: (experts, op, op arguments after (logits, top_k), top_k)
ROUTERS = {
    "qwen3-235b-a22b": (128, "topk_softmax", (True,), 8),
    "deepseek-v3": (256, "grouped_topk", (8, 4, "sigmoid", "bias", True, 2.5), 8),
    "kimi-k2": (384, "grouped_topk", (1, 1, "sigmoid", "bias", True, 2.827), 8),
    "gpt-oss-120b": (128, "topk_then_softmax", (), 4),
}


def _calls(name: str, tokens: int, device: torch.device):
    from atom_kernels.backends.torch import moe as reference
    from atom_kernels.backends.triton import routing

    experts, op, extra, top_k = ROUTERS[name]
    gen = torch.Generator().manual_seed(tokens)
    # Distinct logits (a shuffled grid of multiples of 1/8, exact in bf16): no ties to break.
    rows = [torch.randperm(experts, generator=gen) for _ in range(tokens)]
    logits = (torch.stack(rows).float() * 0.125 - experts / 16).to(torch.bfloat16).to(device)
    bias = (0.05 * torch.randn(experts, generator=gen)).to(device)
    extra = tuple(bias if a == "bias" else a for a in extra)
    return (
        lambda: getattr(reference, op)(logits, top_k, *extra),
        lambda: getattr(routing, op)(logits, top_k, *extra),
    )


def _check(torch_fn, triton_fn) -> str | None:
    (want_w, want_ids), (got_w, got_ids) = torch_fn(), triton_fn()
    if not torch.equal(want_ids.cpu(), got_ids.cpu()):
        return "ids differ"
    diff = float((want_w.float() - got_w.float()).abs().max())
    return None if diff <= 1e-5 else f"weights differ by {diff:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU: check the kernels only")
    args = parser.parse_args()
    from atom_kernels.backends.triton import routing

    routing.ENABLED = True  # the kernels, whatever ATOM_TRITON_ROUTING says
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    rounds, replays = 7, 100
    record = dict(
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__,
        calls_per_graph=CALLS,
        rows=[],
    )
    for name in ROUTERS:
        for tokens in TOKENS[:2] if args.smoke else TOKENS:
            torch_fn, triton_fn = _calls(name, tokens, device)
            row = dict(router=name, tokens=tokens, check=_check(torch_fn, triton_fn) or "ok")
            if cuda and row["check"] == "ok":
                graphs = {"torch": _graph(torch_fn), "triton": _graph(triton_fn)}
                times: dict[str, list[float]] = {k: [] for k in graphs}
                for _ in range(rounds):  # alternated
                    for key, graph in graphs.items():
                        times[key].append(_time_us(graph, replays))
                row.update({f"{k}_us": statistics.median(v) for k, v in times.items()})
                row["speedup"] = row["torch_us"] / row["triton_us"]
            record["rows"].append(row)
            print(
                f"{name:18s} T={tokens:4d} {row['check']:>4s}"
                + (f"  torch {row['torch_us']:6.2f} us  triton {row['triton_us']:6.2f} us"
                   if "torch_us" in row else ""),
                flush=True,
            )  # fmt: skip
            Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
