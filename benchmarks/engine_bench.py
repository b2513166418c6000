"""Engine benchmarks on the GPU: decode latency against the bytes-moved floor, and offline
throughput against `transformers.generate` on the same prompts.

    python benchmarks/engine_bench.py decode --shape llama3-8b --batch-sizes 1 8 64 --out x.json
    python benchmarks/engine_bench.py throughput --shape qwen3-0.6b --workload nanovllm --out y.json

Random weights of the real shapes (weight values do not change a dense model's speed).
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from atom_kernels import envs

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES, config_dir  # noqa: E402


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Measured device-to-device copy bandwidth, bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def make_engine(shape: str, **overrides):
    from atom_engine import EngineConfig, LLMEngine

    args = dict(
        model=config_dir(shape),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        device="cuda",
    )
    args.update(overrides)
    return LLMEngine(EngineConfig(**args))


def weight_bytes(model) -> int:
    """Bytes a decode step reads from weights: all but the input embedding (only B rows)."""
    total = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "embed_tokens" in name and not getattr(model.config, "tie_word_embeddings", False):
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(engine) -> int:
    """Bytes of paged cache one token takes on this rank: each layer's own count (K and V heads,
    or MLA's latent and rotary key), in the cache's dtype (fp8 caches count one byte)."""
    from atom_models.native_host.kv_cache import kv_cache_bytes_per_token

    runner = engine.runner
    return kv_cache_bytes_per_token(runner.model, runner.kv_cache_dtype)


FILTERED = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}  # --sampling filtered: a chat default


def bench_decode(args) -> dict:
    from atom_engine import SamplingParams

    bandwidth = copy_bandwidth()
    results = []
    batched = max(4096, args.prompt_len * 4)
    engine = make_engine(
        args.shape,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=batched,
        enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async,
        max_model_len=4096,
        cudagraph_mode=args.cudagraph_mode,
    )
    wbytes = weight_bytes(engine.runner.model)
    per_token_kv = kv_bytes_per_token(engine)
    rng = random.Random(0)
    vocab = engine.hf_config.vocab_size
    for bs in args.batch_sizes:
        how = FILTERED if args.sampling == "filtered" else {"temperature": 0}
        # The first prompts decode while the last prefill (bs x prompt_len over `batched` steps).
        prefill_steps = -(-bs * args.prompt_len // batched)
        params = SamplingParams(max_tokens=args.steps + 16 + prefill_steps, ignore_eos=True, **how)
        for i in range(bs):
            ids = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            engine.add_request(f"{bs}-{i}", ids, params)
        # Prefill, then a few decode steps, then time decode steps back to back: with async
        # scheduling a step's host work overlaps the device's previous step, so a step is timed
        # as the wall time of many over their count (what a streaming client sees per token).
        while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
            engine.step()
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step = (time.perf_counter() - t0) / args.steps
        assert len(engine.scheduler.running) == bs, "a sequence finished while being timed"
        while engine.has_unfinished_requests():
            engine.step()
        context = args.prompt_len + args.steps // 2
        floor_bytes = wbytes + bs * context * per_token_kv
        floor = floor_bytes / bandwidth
        results.append(
            {
                "batch_size": bs,
                "prompt_len": args.prompt_len,
                "step_ms": step * 1e3,  # mean over the timed steps
                "tokens_per_s": bs / step,
                "floor_ms": floor * 1e3,
                "fraction_of_bandwidth": floor / step,
                "weight_bytes": wbytes,
                "kv_bytes": bs * context * per_token_kv,
                "decode_steps_timed": args.steps,
                "async_scheduling": engine.async_scheduling,
            }
        )
        print(
            f"{args.shape} bs={bs}: {step * 1e3:.2f} ms/step (floor {floor * 1e3:.2f} ms, "
            f"{100 * floor / step:.0f}% of bandwidth)",
            flush=True,
        )
    return {
        "bench": "decode",
        "shape": args.shape,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "cuda_graphs": not args.enforce_eager,
        "cudagraph_mode": args.cudagraph_mode,
        "results": results,
    }


WORKLOADS = ["nanovllm", "512x256", "512x128", "4000x16", "8000x16"]


def workload(name: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    if name == "nanovllm":  # nano-vllm's bench.py: lengths uniform in [100, 1024]
        return [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(n)]
    if name == "512x256":
        return [(512, 256)] * n
    if name == "512x128":  # the device README's transformers reference row (batch 64)
        return [(512, 128)] * n
    if name == "4000x16":  # prefill-bound: long prompts, a few tokens each (issue 42's prefill)
        return [(4000, 16)] * n
    if name == "8000x16":
        return [(8000, 16)] * n
    raise ValueError(name)


def make_prompts(shape: str, name: str, n: int) -> tuple[list[list[int]], list[int]]:
    """The workload's prompts (random token ids) and output lengths, the same in every process."""
    lengths = workload(name, n)
    rng = random.Random(1)
    vocab = SHAPES[shape]().vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(i)] for i, _ in lengths]
    return prompts, [o for _, o in lengths]


def hf_generate_throughput(shape: str, prompts, outs, batch: int, attention: str) -> dict:
    """transformers' generate on the same prompts (left-padded batches), random weights.

    Run in a process of its own (``hf`` subcommand): no memory or state left by the engine. One
    untimed short generate first (CUDA context, cuBLAS handles, kernel selection).

    attention "sdpa-no-cudnn" (the default) keeps torch's SDPA off its cuDNN backend: with it
    (torch 2.11 picks it on an H100), every new key length builds a cuDNN plan, so a first
    generate pays for one per decode step (on an H100, batch 1: 113 ms a step against ~45 warm).
    Flash attention needs no plan: the baseline runs at its steady rate from the first step."""
    from transformers import AutoModelForCausalLM

    if attention == "sdpa-no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)

    config = SHAPES[shape]()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: a smoke test of the script)
    with torch.device(device):  # initialize the random weights on the GPU (8B on a CPU: minutes)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = []
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new, useful = max(outs[i] for i in idx), sum(outs[i] for i in idx)
        batches.append((ids.to(device), mask.to(device), new, useful))

    def generate(ids, mask, new):
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip

    generate(batches[0][0], batches[0][1], 4)  # warm-up, untimed
    sync()
    total_out = 0
    batch_s = []
    t0 = time.perf_counter()
    for ids, mask, new, useful in batches:
        t = time.perf_counter()
        generate(ids, mask, new)
        sync()
        batch_s.append(time.perf_counter() - t)
        total_out += useful  # useful tokens (padding steps not counted)
    elapsed = time.perf_counter() - t0
    return {
        "elapsed_s": elapsed,
        "output_tokens": total_out,
        "output_tok_per_s": total_out / elapsed,
        "batch_size": batch,
        "num_prompts": len(prompts),
        "batch_s": batch_s,
        "attention": attention,
        "transformers": __import__("transformers").__version__,
        "process": "separate",
    }


def run_hf_separately(args, batch: int) -> dict:
    """``hf_generate_throughput`` in a fresh Python process (this file's ``hf`` subcommand)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf.json"
        cmd = [
            sys.executable, __file__, "hf", "--shape", args.shape, "--workload", args.workload,
            "--num-prompts", str(args.num_prompts), "--hf-batch", str(batch),
            "--hf-prompts", str(args.hf_prompts), "--hf-attention", args.hf_attention,
            "--out", str(out),
        ]  # fmt: skip
        child = subprocess.run(cmd, capture_output=True, text=True)
        if child.returncode != 0:  # e.g. out of memory at a large batch: recorded, run goes on
            tail = (child.stderr or child.stdout).strip().splitlines()[-3:]
            print(f"transformers at batch {batch} failed: {' | '.join(tail)}", flush=True)
            return {"batch_size": batch, "error": tail, "returncode": child.returncode}
        return json.loads(out.read_text())


def bench_hf(args) -> dict:
    """The first max(hf_prompts, batch) prompts (at least one full batch)."""
    prompts, outs = make_prompts(args.shape, args.workload, args.num_prompts)
    batch = args.hf_batch[0]
    n = max(args.hf_prompts, batch)
    return hf_generate_throughput(args.shape, prompts[:n], outs[:n], batch, args.hf_attention)


class StepRecorder:
    """Records what each scheduled step computes (new tokens and context length per sequence), by
    wrapping the engine's `Scheduler.schedule`, to price each step at the roofline afterwards."""

    def __init__(self, engine) -> None:
        self.steps: list[list[tuple[int, int]]] = []  # per step: (new tokens, context after)
        self.times: list[float] = []  # perf_counter when each step was scheduled
        schedule = engine.scheduler.schedule

        def recorded():
            batch = schedule()
            if batch.seqs:
                self.times.append(time.perf_counter())
                self.steps.append(
                    [
                        (num, seq.num_computed_tokens + num)
                        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True)
                    ]
                )
            return batch

        engine.scheduler.schedule = recorded


def step_roofline(
    steps, model, config, kv_per_token: int, bandwidth: float, matmul: float, tp_size: int = 1
):
    """Seconds each recorded step needs at least: max( max(bytes / bandwidth, FLOPs / matmul
    rate). Bytes: every weight once (the input embedding only for the step's rows) plus the KV
    read (each sequence's context) and written (its new tokens). FLOPs: 2 x matmul parameters x
    tokens, plus causal attention (2 x 2 x new x context x heads x head_dim per layer, the
    diagonal halved for prefills). With tensor parallelism `model` is one rank's shard and
    `kv_per_token` its cache's: the floor of each rank (they run at once); the LM head and the
    attention heads are split `tp_size` ways."""
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    lm_head = config.vocab_size * config.hidden_size // tp_size
    if getattr(config, "tie_word_embeddings", False):
        params += lm_head  # the tied embedding is read as the LM head
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = config.num_attention_heads // tp_size
    attn = 2 * 2 * heads * head_dim * config.num_hidden_layers
    floors = []
    for step in steps:
        tokens = sum(n for n, _ in step)
        sampled = len(step)
        kv = sum(ctx for _, ctx in step) * kv_per_token + tokens * kv_per_token
        nbytes = params * 2 + kv
        # matmuls: all layers for every token, the LM head only for sampled rows
        flops = 2 * (params - lm_head) * tokens + 2 * lm_head * sampled
        flops += sum(attn * n * (ctx - n / 2) for n, ctx in step)
        floors.append(max(nbytes / bandwidth, flops / matmul))
    return floors


def log_triton_compiles() -> list[tuple[float, str]]:
    """(perf_counter, kernel) of every Triton compile from now on (triton's post-compile hook;
    an empty list on versions without it)."""
    import triton

    compiles: list[tuple[float, str]] = []
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):

        def hook(*, repr, **_):
            compiles.append((time.perf_counter(), repr[:300]))

        runtime.jit_post_compile_hook = hook
    return compiles


def step_breakdown(steps, times: list[float], end: float, floors: list[float]) -> list[dict]:
    """Wall time (from one step's scheduling to the next's) against the roofline, per kind of
    step: prefill-carrying steps, and decode steps by batch size."""
    buckets: dict[str, list[float]] = {}
    for i, step in enumerate(steps):
        wall = (times[i + 1] if i + 1 < len(times) else end) - times[i]
        if any(n > 1 for n, _ in step):
            name = "prefill"
        else:
            name = next(f"decode <= {b}" for b in (8, 32, 64, 128, 256, 1 << 30) if len(step) <= b)
        entry = buckets.setdefault(name, [0, 0.0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += wall
        entry[2] += floors[i]
        entry[3] = max(entry[3], wall)
    return [
        dict(kind=k, steps=n, wall_s=w, roofline_s=f, fraction=f / w if w else 0.0, max_wall_s=m)
        for k, (n, w, f, m) in sorted(buckets.items())
    ]


def bench_throughput(args) -> dict:
    from kernels import measure_roofline

    from atom_engine import SamplingParams

    prompts, outs = make_prompts(args.shape, args.workload, args.num_prompts)
    engine = make_engine(
        args.shape,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(4096, max(len(p) + o for p, o in zip(prompts, outs, strict=True))),
        cudagraph_mode=args.cudagraph_mode,
    )
    # Warm-up (Triton autotuning, allocator).
    engine.add_request("warm", prompts[0][:64], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    roofline = measure_roofline(torch)
    recorder = StepRecorder(engine)
    compiles = log_triton_compiles()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        engine.add_request(
            str(i),
            p,
            SamplingParams(
                max_tokens=o,
                ignore_eos=True,
                output_kind="final_only",
                **(FILTERED if args.sampling == "filtered" else {"temperature": 1.0}),
            ),
        )
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    end = time.perf_counter()
    elapsed = end - t0
    total_out, total_in = sum(outs), sum(len(p) for p in prompts)
    floors = step_roofline(
        recorder.steps,
        engine.runner.model,
        engine.hf_config,
        kv_bytes_per_token(engine),
        roofline["copy_GBps"] * 1e9,
        roofline["matmul_TFLOPs"] * 1e12,
    )
    floor = sum(floors)
    result = {
        "bench": "throughput",
        "shape": args.shape,
        "workload": args.workload,
        "cudagraph_mode": args.cudagraph_mode,
        "num_prompts": args.num_prompts,
        "elapsed_s": elapsed,
        "steps": steps,
        "input_tokens": total_in,
        "output_tokens": total_out,
        "output_tok_per_s": total_out / elapsed,
        "total_tok_per_s": (total_in + total_out) / elapsed,
        "num_preemptions": engine.scheduler.num_preemptions,
        "roofline": roofline,
        "step_roofline_s": floor,
        "fraction_of_step_roofline": floor / elapsed,
        "by_step_kind": step_breakdown(recorder.steps, recorder.times, end, floors),
        # Triton kernels compiled (or loaded from the disk cache) during the timed run: (step, name)
        "triton_compiles": [
            (bisect.bisect_right(recorder.times, t) - 1, name) for t, name in compiles
        ],
        "async_scheduling": engine.async_scheduling,
        "kv_cache_tokens": engine.runner.num_blocks * engine.runner.block_size,
    }
    print(
        f"ATOM {args.shape} {args.workload}: {result['output_tok_per_s']:.0f} out tok/s "
        f"({elapsed:.1f} s, {steps} steps; per-step roofline {floor:.1f} s = "
        f"{100 * floor / elapsed:.0f}%)",
        flush=True,
    )
    for step, name in result["triton_compiles"][:12]:
        print(f"  Triton compile at step {step}: {name[:160]}", flush=True)
    for row in result["by_step_kind"]:
        print(
            f"  {row['kind']:>12}: {row['steps']:5d} steps {row['wall_s']:6.2f} s, "
            f"roofline {row['roofline_s']:6.2f} s ({row['fraction']:.0%}), "
            f"slowest step {1e3 * row['max_wall_s']:.1f} ms",
            flush=True,
        )
    del engine, recorder
    gc.collect()  # the engine holds reference cycles (runner <-> CUDA graphs)
    torch.cuda.empty_cache()
    result["gpu_bytes_held_during_transformers"] = torch.cuda.memory_reserved()
    Path(args.out).write_text(json.dumps(result, indent=2))  # kept if transformers fails
    runs = []
    for batch in (b for b in args.hf_batch if b > 0):
        hf = run_hf_separately(args, batch)
        runs.append(hf)
        if "error" in hf:
            continue
        hf["speedup"] = result["output_tok_per_s"] / hf["output_tok_per_s"]
        print(
            f"transformers generate, batch {batch}: {hf['output_tok_per_s']:.0f} out tok/s "
            f"({hf['num_prompts']} prompts, {hf['attention']}); ATOM x{hf['speedup']:.1f}",
            flush=True,
        )
        Path(args.out).write_text(json.dumps(dict(result, transformers_runs=runs), indent=2))
    done = [hf for hf in runs if "error" not in hf]
    if done:  # the first batch size that ran is the headline comparison
        result["transformers"] = done[0]
        result["speedup_vs_transformers"] = done[0]["speedup"]
    if runs:
        result["transformers_runs"] = runs
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--shape", choices=sorted(SHAPES), required=True)
    d.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    d.add_argument("--prompt-len", type=int, default=512)
    d.add_argument("--steps", type=int, default=48)
    d.add_argument("--enforce-eager", action="store_true")
    d.add_argument("--no-async", action="store_true", help="synchronous steps (no overlap)")
    d.add_argument(
        "--cudagraph-mode",
        default="full",
        help="full_decode_only: the decode graphs alone (a faster start; decode steps the same)",
    )
    t = sub.add_parser("throughput")
    t.add_argument("--shape", choices=sorted(SHAPES), required=True)
    t.add_argument("--workload", choices=WORKLOADS, required=True)
    t.add_argument("--num-prompts", type=int, default=256)
    t.add_argument("--max-num-seqs", type=int, default=256)
    t.add_argument("--max-num-batched-tokens", type=int, default=8192)
    t.add_argument("--cudagraph-mode", default="full")
    h = sub.add_parser("hf", help="transformers generate alone (throughput runs it in a child)")
    h.add_argument("--shape", choices=sorted(SHAPES), required=True)
    h.add_argument("--workload", choices=WORKLOADS, required=True)
    h.add_argument("--num-prompts", type=int, default=256)
    for p in (t, h):
        p.add_argument(
            "--hf-batch",
            type=int,
            nargs="+",
            default=[64],
            help="transformers' batch size(s), one run each (0 skips transformers)",
        )
        p.add_argument(
            "--hf-prompts",
            type=int,
            default=256,
            help="prompts transformers runs (at least one full batch)",
        )
        p.add_argument("--hf-attention", choices=["sdpa-no-cudnn", "sdpa"],
                       default="sdpa-no-cudnn")  # fmt: skip
    for p in (d, t):
        p.add_argument(
            "--sampling",
            choices=["default", "filtered"],
            default="default",
            help="default: greedy decode, temperature 1 throughput; filtered: "
            "temperature 0.8, top-k 50, top-p 0.9 (ATOM_SAMPLE_FILTER=0 A/Bs its kernels)",
        )
    for p in (d, t, h):
        p.add_argument("--out", required=True)
    args = parser.parse_args()
    bench = {"decode": bench_decode, "throughput": bench_throughput, "hf": bench_hf}[args.cmd]
    result = bench(args)
    result.update(
        sampling=getattr(args, "sampling", None),
        sample_filter_kernels=envs.ATOM_SAMPLE_FILTER,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
    )
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
