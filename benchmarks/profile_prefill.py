"""Where a large prefill step's GPU time goes: the kernels of one eager forward of `--prompts`
prompts of `--prompt-len` random tokens (one step of prompts x prompt-len tokens), against the
step's roofline as engine_bench prices it.

    python benchmarks/profile_prefill.py --prompts 16 --prompt-len 512 --out x.json

Reports the step's wall time with each cudagraph mode (host clock around the `LLMEngine.step()`
calls that serve the prompts, synchronized, median of `--repeats`), the roofline of that step,
and the kernels of one eager step by total GPU time (torch.profiler), grouped by kernel name.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_bench import kv_bytes_per_token, make_engine, step_roofline  # noqa: E402
from kernels import measure_roofline  # noqa: E402


def one_step_ms(engine, prompts: list[list[int]], repeats: int) -> list[float]:
    """Wall ms of the step that prefills every prompt (each run on a fresh set of requests)."""
    from atom_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(repeats + 1):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{r}-{i}", {"prompt_token_ids": p}, params)
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        if r:  # the first run warms up
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["full", "full_and_piecewise", "none"],
        help="cudagraph modes to time (the kernels are profiled in `none`, eager)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, 30000, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    tokens = args.prompts * args.prompt_len
    roof = measure_roofline(torch)
    result: dict = dict(
        bench="profile_prefill", shape=args.shape, prompts=args.prompts,
        prompt_len=args.prompt_len, roofline=roof, steps={},
    )  # fmt: skip
    for mode in args.modes:
        engine = make_engine(
            args.shape,
            cudagraph_mode=mode,
            max_num_batched_tokens=max(tokens, 8192),
            max_num_seqs=max(args.prompts, 16),
            enable_prefix_caching=False,
        )
        times = one_step_ms(engine, prompts, args.repeats)
        model = engine.runner.model
        floor = step_roofline(
            [[(args.prompt_len, args.prompt_len)] * args.prompts],
            model,
            engine.hf_config,
            kv_bytes_per_token(engine),
            roof["copy_GBps"] * 1e9,
            roof["matmul_TFLOPs"] * 1e12,
        )[0]
        median = statistics.median(times)
        result["steps"][mode] = dict(
            ms=times, median_ms=median, roofline_ms=floor * 1e3, fraction=floor * 1e3 / median
        )
        print(mode, f"{median:.2f} ms, roofline {floor * 1e3:.2f} ms ({floor * 1e3 / median:.0%})")
        if mode == "none":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                one_step_ms(engine, prompts, 1)
            rows = []
            for e in prof.key_averages():
                if e.device_time_total > 0:
                    rows.append((e.key, e.count, e.device_time_total / 1e3))
            rows.sort(key=lambda r: -r[2])
            total = sum(r[2] for r in rows) / 2  # the profiled call ran two steps
            result["kernels"] = [
                dict(name=n[:160], count=c // 2, ms=t / 2) for n, c, t in rows[: args.top]
            ]
            result["kernel_ms_per_step"] = total
            print(f"kernels: {total:.2f} ms a step")
            for n, c, t in rows[: args.top]:
                print(f"  {t / 2:8.3f} ms  {c // 2:5d}  {n[:110]}")
        engine.shutdown()
        del engine, model
        gc.collect()  # engines hold reference cycles (runner <-> CUDA graphs)
        torch.cuda.empty_cache()
    result.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
