"""Where a decode step's time goes: the engine's step on the host against the CUDA graph on the GPU,
and the kernels of one decode forward.

    python benchmarks/profile_decode.py --shape qwen3-0.6b --batch-size 1 --out x.json

Reports, for one batch size of the real shape (random weights):
- ``step_ms``: `LLMEngine.step()` wall time per decode step, steps back to back (what a user sees);
- ``graph_ms``: one replay of the captured decode graph alone (GPU time, CUDA events);
- ``tail_ms``: the logits and the greedy argmax after the graph (GPU time);
- ``sample_ms``: ``atom_kernels.sample`` over those logits at ``--temperature`` (GPU time);
- the kernels of one eager decode forward, by total GPU time (torch.profiler);
- ``timeline``: ``--timeline-steps`` engine steps under torch.profiler: their wall time, the GPU's
  busy time (the union of the kernels' intervals) and idle gaps, and the kernels outside the
  graph replays (the logits, sampling and copies every step launches from the host).
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
from engine_bench import make_engine  # noqa: E402
from shapes import SHAPES  # noqa: E402


def gpu_ms(fn, iters: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    import atom_kernels
    from atom_engine import SamplingParams
    from atom_models import set_forward_context

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="of the timed steps")
    parser.add_argument("--timeline-steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    engine = make_engine(
        args.shape, max_num_seqs=max(8, args.batch_size), max_model_len=4096,
    )  # fmt: skip
    bs = args.batch_size
    # Every sequence still decoding when profiled: the prompts prefill a step's token budget at a
    # time while the first ones already decode (at batch 256 x 512 tokens, 64 steps of 2048: with
    # steps + 8 outputs the first ~110 sequences had finished before the profile).
    prefill_steps = -(-bs * args.prompt_len // engine.config.max_num_batched_tokens)
    max_tokens = prefill_steps + args.steps + args.timeline_steps + 16
    params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
    for i in range(bs):
        engine.add_request(str(i), [(7 * i + j) % 1000 for j in range(args.prompt_len)], params)
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = args.steps // 2
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / steps * 1e3

    runner = engine.runner
    graphs = runner.graphs.decode
    contexts = [len(seq) for seq in engine.scheduler.running]  # when the graph is timed
    size = next(b for b in graphs.sizes if b >= bs)
    graph, hidden = graphs.graphs[size]
    graph_ms = gpu_ms(graph.replay)
    tail_ms = gpu_ms(lambda: runner.model.compute_logits(hidden[:bs]).float().argmax(-1))
    logits = runner.model.compute_logits(hidden[:bs])
    temperature = torch.full((bs,), max(args.temperature, 1e-5), device=logits.device)
    sample_ms = gpu_ms(lambda: atom_kernels.sample(logits, temperature, None, None, None))

    def forward():  # the graph's forward, eagerly (ids gathered as the graph does)
        with set_forward_context(graphs._metadata(size)):
            graphs._forward(size)

    eager_ms = gpu_ms(forward, iters=20)
    from torch.profiler import ProfilerActivity, profile

    forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time_total / 1e3)
    table = sorted(
        ({"kernel": k[:120], "count": len(v), "total_ms": sum(v)} for k, v in kernels.items()),
        key=lambda r: -r["total_ms"],
    )
    timeline = None
    if args.timeline_steps:
        timeline = step_timeline(engine, args.timeline_steps, set(kernels))
    result = {
        "timeline": timeline,
        "shape": args.shape,
        "batch_size": bs,
        "live_sequences": len(contexts),
        "context_mean": sum(contexts) / max(len(contexts), 1),
        "step_ms": step_ms,
        "graph_ms": graph_ms,
        "tail_ms": tail_ms,
        "sample_ms": sample_ms,
        "temperature": args.temperature,
        "eager_forward_gpu_ms": eager_ms,
        "num_kernels": sum(r["count"] for r in table),
        "kernel_sum_ms": sum(r["total_ms"] for r in table),
        "kernels": table[:40],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    print(
        f"{args.shape} bs={bs} ({len(contexts)} live, context {result['context_mean']:.0f}): "
        f"step {step_ms:.3f} ms | graph {graph_ms:.3f} ms | "
        f"logits+argmax {tail_ms:.3f} ms | sample {sample_ms:.3f} ms | "
        f"eager forward {eager_ms:.3f} ms | "
        f"{result['num_kernels']} kernels, sum {result['kernel_sum_ms']:.3f} ms"
    )
    for r in table[:25]:
        print(f"  {r['total_ms']:8.4f} ms  x{r['count']:<4d} {r['kernel'][:100]}")
    if timeline:
        print(
            f"timeline, {timeline['steps']} steps: wall {timeline['wall_ms_per_step']:.3f} ms | "
            f"GPU busy {timeline['gpu_busy_ms_per_step']:.3f} ms | "
            f"largest idle gaps (us) {timeline['largest_gaps_us'][:8]}"
        )
        for r in timeline["outside_graph_kernels"][:12]:
            print(f"  outside graph: {r['total_ms']:8.4f} ms x{r['count']:<4d} {r['kernel'][:90]}")
    Path(args.out).write_text(json.dumps(result, indent=2))


def step_timeline(engine, steps: int, forward_kernels: set[str]) -> dict:
    """Engine steps under torch.profiler: wall, GPU busy (union of kernel intervals), idle gaps,
    and the kernels that are not the forward's (`forward_kernels`: the names in the eager
    forward's profile; the graph replays those)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    spans, outside = [], {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end  # us
        spans.append((start, end))
        if e.name not in forward_kernels:
            outside.setdefault(e.name[:120], []).append((end - start) / 1e3)
    spans.sort()
    busy, gaps, cur_s, cur_e = 0.0, [], None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "largest_gaps_us": sorted((round(g, 1) for g in gaps), reverse=True)[:32],
        "outside_graph_kernels": sorted(
            ({"kernel": k, "count": len(v), "total_ms": sum(v)} for k, v in outside.items()),
            key=lambda r: -r["total_ms"],
        ),
    }


if __name__ == "__main__":
    main()
