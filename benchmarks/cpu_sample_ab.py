"""The CPU `sample` op: the torch reference (exponential race) against the cpu backend's
(inverse-CDF over vocabulary blocks), alone and inside the engine's decode step, alternating.

- op: `sample` on [B, 49152] float32 logits (SmolLM2's vocabulary), temperature 1, no filters
  (what `vllm bench serve` sends by default), 1 thread: min and median of `--op-calls` calls;
- engine: one `atom_engine.LLM` (SmolLM2-135M converted, float32, compiled forward, 1 thread);
  a decode step at temperature 1 is (generate to 1 + N tokens - generate to 1) / N for B prompts
  of 128 random tokens, with the registry's `sample` for CPU set to one implementation or the
  other, alternating within each repeat so a load change hits both.

    uv run python benchmarks/cpu_sample_ab.py --out benchmarks/results/cpu-sample-ab-s12.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from atom_kernels import registry
from atom_kernels.backends.cpu import sampling as cpu_sampling
from atom_kernels.backends.torch import sampling as ref_sampling

IMPLS = {"reference": ref_sampling.sample, "cpu": cpu_sampling.sample}


def op_times(batch: int, calls: int) -> dict:
    logits = torch.randn(batch, 49152) * 3
    temperature = torch.ones(batch)
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    for _ in range(calls):
        for name, fn in IMPLS.items():
            started = time.perf_counter()
            fn(logits, temperature, None, None, None, None, 0).token_ids.tolist()
            times[name].append((time.perf_counter() - started) * 1e3)
    return {
        name: {"min_ms": round(min(t), 3), "median_ms": round(statistics.median(t), 3)}
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/atom-smollm2-hf"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--op-calls", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from atom_engine import LLM, SamplingParams

    result = {"load_before": os.getloadavg()[0], "torch": torch.__version__, "op": {}}
    llm = LLM(str(args.model_dir), dtype="float32", max_model_len=1024, num_threads=1)
    result["torch_threads"] = torch.get_num_threads()
    for batch in args.batch_sizes:
        result["op"][str(batch)] = op_times(batch, args.op_calls)

    def generate(prompts, n):
        params = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - started

    g = torch.Generator().manual_seed(0)
    result["engine_step_ms"] = {}
    for batch in args.batch_sizes:
        prompts = torch.randint(100, 40000, (batch, 128), generator=g).tolist()
        steps: dict[str, list[float]] = {name: [] for name in IMPLS}
        for _ in range(args.repeats):
            for name, fn in IMPLS.items():
                registry._RESOLVED[("sample", "cpu")] = fn  # what atom_kernels.sample calls
                generate(prompts, 2)
                short = generate(prompts, 1)
                long = generate(prompts, 1 + args.decode_steps)
                steps[name].append(round((long - short) / args.decode_steps * 1e3, 1))
        result["engine_step_ms"][str(batch)] = {
            name: {"runs": t, "median": statistics.median(t)} for name, t in steps.items()
        }
        print(batch, result["engine_step_ms"][str(batch)], flush=True)
    registry._RESOLVED.pop(("sample", "cpu"), None)
    result["load_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["op"], indent=1))


if __name__ == "__main__":
    main()
