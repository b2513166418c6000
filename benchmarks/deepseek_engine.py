"""A DeepSeek-V3-shaped model cut to 4 layers (real widths, block-FP8 weights, random values)
through the engine on one GPU: decode latency at batch 1 and 64, and throughput on 256 requests
of 512 in / 256 out, each against its roofline measured in the same run (issue 17, item 3).

    python benchmarks/deepseek_engine.py --out x.json
    python benchmarks/deepseek_engine.py --smoke --out x.json     # tiny stand-in, CPU or GPU
    ATOM_FLASHINFER=mla_decode python benchmarks/deepseek_engine.py --batches 1 16 64 \
        --prompt-len 4096 --max-model-len 4200 --no-throughput --out x.json  # FlashInfer's MLA

Decode floor: the bytes a step reads over the copy bandwidth: every weight but the routed experts
and the input embedding, the routed experts a step reaches (E * (1 - (1 - k/E)^B) per MoE layer for
B sequences routed uniformly over E experts, top-k: random weights route about uniformly), and the
latent cache. Throughput: the wall time against the sum of the per-step floors, each step priced at
max(bytes / bandwidth, FLOPs / matmul rate) as engine_bench.py does for the dense shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import config_dir  # noqa: E402


def expert_bytes(model) -> tuple[int, int, int]:
    """(bytes of all routed experts per MoE layer, MoE layers, bytes of the other weights a decode
    step reads: all but the experts and the input embedding)."""
    experts = other = 0
    layers = set()
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts." in name:
            experts += size
            layers.add(name.split(".mlp")[0])
        elif "embed_tokens" not in name:
            other += size
    return experts // max(1, len(layers)), len(layers), other


def profile_steps(engine, steps: int) -> list[dict]:
    """The CUDA kernels of `steps` engine steps, by total time (the 15 heaviest)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    return [
        {"kernel": e.key[:100], "count": e.count, "total_ms": e.device_time_total / 1e3}
        for e in rows[:15]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny stand-in (CPU smoke run)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument(
        "--profile", action="store_true", help="also: top CUDA kernels of 4 decode steps per batch"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="decode batches")
    parser.add_argument("--prompt-len", type=int, help="decode prompts' tokens (512; smoke 32)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--no-throughput", action="store_true", help="decode latency only (no offline run)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from atom_engine import EngineConfig, LLMEngine, SamplingParams

    cuda = torch.cuda.is_available()
    model = config_dir("deepseek-v3-4l", smoke=args.smoke)
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model, load_format="dummy", skip_tokenizer_init=True,
            dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu",
            max_num_seqs=256, max_model_len=args.max_model_len,
        )
    )  # fmt: skip
    startup_s = time.perf_counter() - started
    hf = engine.hf_config
    routed, moe_layers, other = expert_bytes(engine.runner.model)
    num_experts, top_k = hf.n_routed_experts, hf.num_experts_per_tok
    latent = 0
    from atom_models.native_host import cache_layers

    for layer in cache_layers(engine.runner.model):
        latent += layer.cache_bytes_per_token(engine.runner.kv_cache_dtype)
    if cuda:
        from kernels import measure_roofline

        roofline = measure_roofline(torch)
    else:
        roofline = {"copy_GBps": 10.0, "matmul_TFLOPs": 0.1}  # smoke runs only
    bandwidth = roofline["copy_GBps"] * 1e9
    rate = roofline["matmul_TFLOPs"] * 1e12
    rng = random.Random(0)
    vocab = hf.vocab_size
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def reached(batch: int) -> float:
        return num_experts * (1 - (1 - top_k / num_experts) ** batch)

    result = {
        "bench": "deepseek_engine",
        "shape": "deepseek-v3-4l" + (" (smoke)" if args.smoke else ""),
        "startup_s": startup_s,
        "roofline": roofline,
        "weights": {
            "routed_expert_bytes_per_moe_layer": routed,
            "moe_layers": moe_layers,
            "other_bytes": other,
            "latent_cache_bytes_per_token": latent,
        },
        "decode": [],
    }
    prompt_len = args.prompt_len or (512 if not args.smoke else 32)
    result["prompt_len"] = prompt_len
    graphs = engine.runner.graphs
    # The decode graphs' batches that run FlashInfer's MLA decode (ATOM_FLASHINFER=mla_decode).
    result["flashinfer_mla_batches"] = sorted(graphs.decode.mla) if graphs is not None else []
    result["flashinfer"] = os.environ.get("ATOM_FLASHINFER", "auto")
    for batch in args.batches:
        params = SamplingParams(temperature=0, max_tokens=args.steps + 16, ignore_eos=True)
        for i in range(batch):
            ids = [rng.randrange(vocab) for _ in range(prompt_len)]
            engine.add_request(f"d{batch}-{i}", ids, params)
        while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
            engine.step()
        for _ in range(4):
            engine.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        step = (time.perf_counter() - t0) / args.steps
        kernels = profile_steps(engine, 4) if args.profile and cuda else None
        while engine.has_unfinished_requests():
            engine.step()
        context = prompt_len + 4 + args.steps // 2
        floor_bytes = other + moe_layers * routed * reached(batch) / num_experts
        floor_bytes += batch * context * latent
        floor = floor_bytes / bandwidth
        row = {
            "batch_size": batch,
            "step_ms": 1e3 * step,
            "tokens_per_s": batch / step,
            "floor_ms": 1e3 * floor,
            "fraction_of_bandwidth": floor / step,
            "experts_reached_per_layer": reached(batch),
        }
        if kernels is not None:
            row["top_kernels_4_steps"] = kernels
        result["decode"].append(row)
        print(json.dumps(row), flush=True)

    if graphs is not None and graphs.decode.mla:  # the host's cost of FlashInfer's plan
        size = max(graphs.decode.mla)
        planned = graphs.decode.mla[size]
        lens = [prompt_len] * size
        # The staged rows the decode graphs pass: [sequences, blocks], each row's blocks first.
        width = -(-prompt_len // 16)
        tables = (np.arange(size)[:, None] * 300 + np.arange(width)).astype(np.int32)
        t0 = time.perf_counter()
        for _ in range(20):
            planned.plan(lens, tables)
        sync()
        result["flashinfer_plan_ms"] = {
            "batch": size,
            "context": prompt_len,
            "ms": 1e3 * (time.perf_counter() - t0) / 20,
        }
        print(json.dumps(result["flashinfer_plan_ms"]), flush=True)
    if args.no_throughput:
        _finish(result, args.out, cuda)
        return
    # Throughput: every request at once, 512 in / 256 out (scaled down in the smoke run).
    from engine_bench import StepRecorder

    n_in, n_out = (512, 256) if not args.smoke else (32, 8)
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"t{i}", [rng.randrange(vocab) for _ in range(n_in)], params)
    # Matmul parameters a token goes through (routed experts: top-k of E); attention's own FLOPs
    # are left out (about 1% of a token's at these lengths).
    params_active = 0.0
    for name, p in engine.runner.model.named_parameters():
        if "embed_tokens" not in name and p.dim() >= 2 and p.dtype != torch.float32:
            params_active += p.numel() * (top_k / num_experts if ".experts." in name else 1.0)
    recorder = StepRecorder(engine)
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    elapsed = time.perf_counter() - t0
    floor_s = 0.0
    for step in recorder.steps:
        tokens = sum(n for n, _ in step)
        step_bytes = other + moe_layers * routed * reached(tokens) / num_experts
        step_bytes += sum(context for _, context in step) * latent
        floor_s += max(step_bytes / bandwidth, 2 * params_active * tokens / rate)
    steps = len(recorder.steps)
    result["throughput"] = {
        "requests": args.requests,
        "input_len": n_in,
        "output_len": n_out,
        "elapsed_s": elapsed,
        "steps": steps,
        "output_tok_per_s": args.requests * n_out / elapsed,
        "total_tok_per_s": args.requests * (n_in + n_out) / elapsed,
        "step_roofline_s": floor_s,
        "fraction_of_step_roofline": floor_s / elapsed,
        "matmul_params_per_token": params_active,
    }
    print(json.dumps(result["throughput"]), flush=True)
    _finish(result, args.out, cuda)


def _finish(result: dict, out: str, cuda: bool) -> None:
    result["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    result["torch"] = torch.__version__
    result["date"] = time.strftime("%Y-%m-%d")
    Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
