"""Where a CPU step's time goes: ATOM's engine against vLLM's own model, offline, same machine.

For one implementation (`--impl atom`: `atom_engine.LLM`; `--impl vllm`: `vllm.LLM` with its engine
core in this process) on SmolLM2-135M-Instruct in float32 (the bundled GGUF converted to an HF
directory, so both read the same checkpoint), greedy, ignore_eos:

- decode at batch 1 and 8: B prompts of 128 random tokens, generated to 1 and to 1 + N tokens;
  the step time is the difference over N (prefills cancel out);
- a 512-token prefill: one prompt generated to 1 token;
- a torch.profiler table (self CPU time per op, top rows) of the decode runs at each batch and of
  the prefill, so the split between GEMMs, attention, norms, sampling and Python shows.

    uv run python benchmarks/profile_cpu.py --impl atom \
        --out benchmarks/results/profile-cpu-atom.json
    ~/.cache/atom-ci/vllm-0.32.0/bin/python benchmarks/profile_cpu.py --impl vllm \
        --model-dir /tmp/smollm2 --out benchmarks/results/profile-cpu-vllm.json

The machine's 1-minute load is recorded before and after; timings under load mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch


def convert_smollm2(out: Path) -> Path:
    if not (out / "config.json").exists():
        from atom_models.bundled import smollm2_gguf_path

        subprocess.run(
            [sys.executable, "-m", "atom_models.convert", str(smollm2_gguf_path()), str(out)],
            check=True,
            capture_output=True,
        )
    return out


class Runner:
    """generate(prompt token lists, max_tokens) -> wall seconds, for one implementation."""

    def __init__(self, impl: str, model_dir: Path, threads: int | None) -> None:
        self.impl = impl
        if impl == "atom":
            from atom_engine import LLM, SamplingParams

            args = {} if threads is None else {"num_threads": threads}
            self.llm = LLM(str(model_dir), dtype="float32", max_model_len=1024, **args)
            self.params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            self.prompt = lambda ids: {"prompt_token_ids": ids}
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from vllm import LLM, SamplingParams

            self.llm = LLM(
                str(model_dir), dtype="float32", max_model_len=1024, seed=0,
                max_num_batched_tokens=1024,
            )  # fmt: skip
            self.params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            self.prompt = lambda ids: {"prompt_token_ids": ids}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        started = time.perf_counter()
        outs = self.llm.generate(
            [self.prompt(p) for p in prompts], self.params(max_tokens), use_tqdm=False
        )
        elapsed = time.perf_counter() - started
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed


def profile_table(fn, rows: int) -> tuple[list[dict], float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        fn()
        wall = time.perf_counter() - started
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    table = [
        {
            "op": e.key,
            "calls": e.count,
            "self_ms": round(e.self_cpu_time_total / 1e3, 2),
            "total_ms": round(e.cpu_time_total / 1e3, 2),
        }
        for e in events[:rows]
    ]
    return table, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=["atom", "vllm"], required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/atom-smollm2-hf"))
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--profile-steps", type=int, default=4, help="decode steps profiled")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many timings")
    parser.add_argument("--rows", type=int, default=25, help="profiler rows kept")
    parser.add_argument("--threads", type=int, default=None, help="ATOM's --num-threads")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    model_dir = convert_smollm2(args.model_dir)
    result = {
        "impl": args.impl,
        "load_before": os.getloadavg()[0],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (bundled GGUF -> HF), float32",
    }
    runner = Runner(args.impl, model_dir, args.threads)
    result["torch_threads"] = torch.get_num_threads()
    rng = random.Random(0)

    def prompts(batch: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(batch)]

    def median(fn) -> float:
        times = sorted(fn() for _ in range(args.repeats))
        return times[len(times) // 2]

    runner.generate(prompts(2, 64), 4)  # warm-up (compilation, first allocations)
    result["decode"] = {}
    for batch in args.batch_sizes:
        ps = prompts(batch, 128)
        runner.generate(ps, 2)
        short = median(lambda ps=ps: runner.generate(ps, 1))
        long = median(lambda ps=ps: runner.generate(ps, 1 + args.decode_steps))
        step_ms = (long - short) / args.decode_steps * 1e3
        table, _ = profile_table(lambda ps=ps: runner.generate(ps, 1 + args.profile_steps),
                                 args.rows)  # fmt: skip
        result["decode"][str(batch)] = {
            "step_ms": round(step_ms, 2),
            "tokens_per_s": round(batch * 1e3 / step_ms, 1),
            "profile_top_self_cpu": table,
        }
        print(f"{args.impl} decode batch {batch}: {step_ms:.1f} ms/step", flush=True)
    ps = prompts(1, args.prefill_len)
    runner.generate(ps, 1)
    prefill = median(lambda: runner.generate(ps, 1))
    table, _ = profile_table(lambda: runner.generate(ps, 1), args.rows)
    result["prefill"] = {
        "tokens": args.prefill_len,
        "ms": round(prefill * 1e3, 1),
        "profile_top_self_cpu": table,
    }
    print(f"{args.impl} prefill {args.prefill_len}: {prefill * 1e3:.0f} ms", flush=True)
    result["load_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
