"""Two GPUs: the engine's tensor, data and expert parallelism against one GPU (issues 18, 34).

    python benchmarks/multi_gpu.py --out benchmarks/results/multi-gpu-2xh200.json [--budget-s 330]
    python benchmarks/multi_gpu.py --smoke --out /tmp/multi-gpu-smoke.json   # CPU, gloo, tiny

The cases are in collectives.py (roofline, allreduce) and multi_gpu_engine.py (the engines).
Each case runs in a process of its own (its GPU memory and worker processes end with it), in this
order; the JSON is rewritten after each, and a case that fails or would outrun the budget is
recorded as such while the others go on:
- roofline: each GPU's copy bandwidth (read + write) and bf16 8192^3 matmul rate (kernels.py),
  and the GPU-to-GPU copy rate;
- allreduce: the all-reduce of a [tokens, hidden] bf16 tensor between the two GPUs alone, over the
  engine's own process group (EngineTPGroup, NCCL): eager, and inside a CUDA graph as the decode
  graphs run it; and the all-gather of the LM head's logits;
- llama3-8b-tp1, llama3-8b-tp2: decode latency at batch 1 / 8 / 64 (as `engine_bench.py decode`:
  512-token prompts, CUDA graphs, async scheduling) and the offline 512-in / 256-out workload
  (256 requests at once, as `engine_bench.py throughput`); TP=2 also profiles decode steps with
  torch.profiler: rank 0's NCCL kernel time per step;
- llama3-8b-dp2: the same offline workload over two TP=1 replicas, one per GPU, through
  `LLM(data_parallel_size=2)` (one engine process per replica, pinned to its GPU, as
  `atom serve -dp 2` runs them): one `generate` call of all 256 requests, timed to its return;
- qwen3-30b-a3b-tp2, qwen3-30b-a3b-tp2-ep: decode latency and the offline workload, the experts
  sliced over both GPUs against whole experts per GPU;
- llama3-8b-tp4 (4 GPUs), qwen3-235b-a22b-fp8-tp4-ep-b1 (4 GPUs, all 94 layers, block FP8;
  batch-1 decode only, on a small engine);
- `--moe4` (4 GPUs, issue 37): qwen3-235b-a22b-fp8 and deepseek-v3-40l (DeepSeek-V3 cut to 40 of
  its 61 layers: 3 dense, 37 MoE, MLA; ~431 GB: 4x H200; on GPUs under 100 GiB deepseek-v3-24l,
  3 dense and 21 MoE layers, ~245 GB) at TP=4 (`-tp4`), TP=4 + EP (`-tp4-ep`)
  and TP=4 + EP + an fp8 KV cache (`-tp4-ep-fp8kv`), full engines; each also as `<case>-b1`
  (batch-1 decode alone, small engine);
- <any TP case>-peer: the same with `ATOM_ALLREDUCE=peer` (the peer all-reduce, issue 36; the
  engine's default) where the case without the suffix runs NCCL (`ATOM_ALLREDUCE=nccl`): run both
  in one call to compare.

Random weights (load_format="dummy"). A decode floor is rank 0's weight bytes (its shard: the ranks
read theirs at once) plus its KV read, over the copy bandwidth measured in this run; for the MoE,
the expert weights count by the share of experts a batch of B tokens hits under uniform top-k
routing, 1 - (1 - k / E)^B (E: `num_experts`, `n_routed_experts` or `num_local_experts`); the
KV read is each layer's own cache bytes per token in the cache's dtype (MLA: its latent).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from collectives import case_allreduce, case_roofline  # noqa: E402
from multi_gpu_engine import ENGINE_CASES, case_engine  # noqa: E402

CASES = ["roofline", "allreduce", *ENGINE_CASES]
# --moe4: the flagship MoE shapes on 4 GPUs (issue 37), full engines (decode 1 / 8 / 64, offline).
MOE4_CASES = [
    "roofline",
    *(
        f"{shape}-tp4{suffix}"
        for shape in ("qwen3-235b-a22b-fp8", "deepseek-v3-40l")
        for suffix in ("", "-ep", "-ep-fp8kv")
    ),
]
# The default run: everything but the flagship shapes' full engines (batch 1 of one of them stays).
DEFAULT_CASES = [
    name
    for name in CASES
    if not name.startswith(("qwen3-235b", "deepseek-v3-40l", "deepseek-v3-24l"))
    or name == "qwen3-235b-a22b-fp8-tp4-ep-b1"
]


def run_case(name: str, args) -> None:
    """This process runs one case (the driver's child) and writes its JSON to --out."""
    print(f"=== {name} ({time.strftime('%H:%M:%S')})", flush=True)
    if name == "roofline":
        result = case_roofline(args)
    elif name == "allreduce":
        result = case_allreduce(args)
    else:
        result = case_engine(name, args)
    Path(args.out).write_text(json.dumps(result, indent=2))


def summary(record: dict) -> list[str]:
    """The table printed last: decode ms per step and offline out tok/s per case."""
    lines = [f"{'case':30s} {'bs 1':>8s} {'bs 8':>8s} {'bs 64':>8s} {'offline tok/s':>14s}"]
    for name in ENGINE_CASES:
        case = record["cases"].get(name)
        if case is None:
            continue
        if "error" in case:
            lines.append(f"{name:30s} {case['error'][:60]}")
            continue
        decode = {r["batch_size"]: f"{r['step_ms']:.2f}" for r in case.get("decode", [])}
        offline = (case.get("offline") or {}).get("output_tok_per_s")
        lines.append(
            f"{name:30s} "
            + " ".join(f"{decode.get(b, '-'):>8s}" for b in (1, 8, 64))
            + f" {offline or 0:14.0f}"
        )
    tp1 = record["cases"].get("llama3-8b-tp1", {})
    for n, target in ((2, 0.62), (4, 0.45)):
        for suffix in ("", "-peer"):
            tpn = record["cases"].get(f"llama3-8b-tp{n}{suffix}", {})
            if tp1.get("decode") and tpn.get("decode"):
                ratio = tpn["decode"][0]["step_ms"] / tp1["decode"][0]["step_ms"]
                key = f"llama3_8b_tp{n}{suffix.replace('-', '_')}_over_tp1_batch1"
                record[key] = ratio
                lines.append(
                    f"Llama-3-8B batch 1: TP={n}{suffix} / TP=1 = {ratio:.2f} (target <= {target})"
                )
    return lines


def _gpu_gib() -> float:
    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, gloo: no GPU)")
    parser.add_argument("--only", nargs="+", choices=CASES, help="these cases, in this order")
    parser.add_argument(
        "--moe4",
        action="store_true",
        help="the 4-GPU MoE mode: Qwen3-235B-A22B-FP8 and DeepSeek-V3 (40 layers) at TP=4, "
        "TP=4 + EP and TP=4 + EP + fp8 KV cache",
    )
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="stop starting cases past this many seconds"
    )
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # a child's one case
    parser.add_argument("--bandwidth", type=float, help=argparse.SUPPRESS)  # bytes/s, from roofline
    parser.add_argument("--matmul", type=float, help=argparse.SUPPRESS)  # FLOP/s
    args = parser.parse_args()
    if args.only is None:
        args.only = MOE4_CASES if args.moe4 else DEFAULT_CASES
        if args.moe4 and not args.smoke and _gpu_gib() < 100:  # 4x H100: DeepSeek-V3 cut further
            args.only = [n.replace("deepseek-v3-40l", "deepseek-v3-24l") for n in args.only]
    if args.case:
        run_case(args.case, args)
        return
    start = time.monotonic()
    record = dict(
        date=time.strftime("%Y-%m-%d"),
        torch=torch.__version__,
        smoke=args.smoke,
        devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        budget_s=args.budget_s,
        cases={},
    )
    extra: list[str] = []
    for name in args.only:
        left = args.budget_s - (time.monotonic() - start)
        if left < 30:
            record["cases"][name] = {"error": f"not run: {left:.0f} s of the budget left"}
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, __file__, "--case", name, "--out", tmp.name, *extra]
            cmd += ["--smoke"] if args.smoke else []
            t0 = time.monotonic()
            try:
                child = subprocess.run(cmd, timeout=left, env=dict(os.environ))
                code = child.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            text = Path(tmp.name).read_text()
        if code == 0 and text:
            result = json.loads(text)
        else:
            result = {"error": f"exit status {code} after {time.monotonic() - t0:.0f} s"}
        result["wall_s"] = time.monotonic() - t0
        record["cases"][name] = result
        if name == "roofline" and "gpus" in result:  # GPU 0's: the rank 0 every floor is of
            gpu0 = result["gpus"][0]
            extra = [
                "--bandwidth",
                str(gpu0["copy_GBps"] * 1e9),
                "--matmul",
                str(gpu0["matmul_TFLOPs"] * 1e12),
            ]
        Path(args.out).write_text(json.dumps(record, indent=2))
    lines = summary(record)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
