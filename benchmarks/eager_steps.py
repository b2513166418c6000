"""Eager (prefill + decode) steps against graph-replayed decode steps, on a workload shaped like
`atom bench serve` at concurrency 64: the Qwen3-0.6B serving shape (vocabulary cut to the bundled
tokenizer's), 512-token prompts, 128 output tokens, at most 64 sequences running.

    python benchmarks/eager_steps.py --requests 128 --out x.json            # as the engine runs
    python benchmarks/eager_steps.py --requests 128 --custom-op-dispatch --out y.json
    python benchmarks/eager_steps.py --requests 128 --cudagraph-mode full_decode_only --out z.json

A step's time is the wall time between two scheduled steps. "mixed" steps carry prefill tokens
and replay piecewise CUDA graphs (eagerly with `--cudagraph-mode full_decode_only`); "decode"
steps (at least 48 sequences, no prefill) replay a whole-forward CUDA graph.
``--custom-op-dispatch`` routes every Triton kernel through its torch custom op even in eager
code (what the engine did before the registry's entries called the host code directly).
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
from engine_bench import StepRecorder  # noqa: E402
from shapes import config_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--custom-op-dispatch", action="store_true")
    parser.add_argument("--cudagraph-mode", default="full")
    parser.add_argument(
        "--profile-host", metavar="FILE", help="cProfile the timed steps; top functions to FILE"
    )
    parser.add_argument("--tokenizer", default=".bench_assets/tokenizer")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from atom_engine import EngineConfig, LLMEngine, SamplingParams

    if args.custom_op_dispatch:
        from atom_kernels.backends.triton import custom_ops

        custom_ops.DIRECT_EAGER = False
    model = config_dir("qwen3-0.6b", args.tokenizer, "/tmp/qwen3-eager-steps")
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
            device="cuda", max_num_seqs=64, cudagraph_mode=args.cudagraph_mode,
        )
    )  # fmt: skip
    startup_s = time.perf_counter() - started
    gen = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(3, 49000, (512,), generator=gen).tolist() for _ in range(n)]

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for i, p in enumerate(prompts(8)):  # warm-up
        engine.add_request(f"w{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()

    recorder = StepRecorder(engine)
    for i, p in enumerate(prompts(args.requests)):
        engine.add_request(str(i), p, params)
    torch.cuda.synchronize()
    profiler = None
    if args.profile_host:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        Path(args.profile_host).write_text(text.getvalue())
    # (wall time to the next step, prefill tokens, sequences) per scheduled step
    times = recorder.times
    walls = [
        (b - a, sum(n for n, _ in step if n > 1), len(step))
        for a, b, step in zip(times, times[1:], recorder.steps, strict=False)
    ]
    decode = [w for w, prefill, seqs in walls if prefill == 0 and seqs >= 48]
    mixed = [w for w, prefill, _ in walls if prefill > 0]
    result = {
        "bench": "eager_steps",
        "dispatch": "custom_op" if args.custom_op_dispatch else "direct",
        "cudagraph_mode": args.cudagraph_mode,
        "startup_s": startup_s,
        "requests": args.requests,
        "elapsed_s": elapsed,
        "output_tok_per_s": args.requests * 128 / elapsed,
        "steps": steps,
        "decode_steps": len(decode),
        "decode_ms_mean": 1e3 * statistics.mean(decode),
        "decode_ms_median": 1e3 * statistics.median(decode),
        "mixed_steps": len(mixed),
        "mixed_ms_mean": 1e3 * statistics.mean(mixed),
        "mixed_ms_median": 1e3 * statistics.median(mixed),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
