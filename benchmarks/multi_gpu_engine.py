"""The engine cases of multi_gpu.py: one engine (or data-parallel replicas) of a real shape with
random weights, its decode latency at batch 1 / 8 / 64 and the offline 512-in / 256-out workload.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from collectives import sync  # noqa: E402
from engine_bench import (  # noqa: E402
    StepRecorder,
    kv_bytes_per_token,
    step_roofline,
    weight_bytes,
    workload,
)
from shapes import shape_config  # noqa: E402

ENGINE_CASES = {
    "llama3-8b-tp1": ("llama3-8b", dict(tensor_parallel_size=1)),
    "llama3-8b-tp2": ("llama3-8b", dict(tensor_parallel_size=2)),
    "llama3-8b-tp4": ("llama3-8b", dict(tensor_parallel_size=4)),
    "llama3-8b-dp2": ("llama3-8b", dict(data_parallel_size=2)),
    "qwen3-30b-a3b-tp2": ("qwen3-30b-a3b", dict(tensor_parallel_size=2)),
    "qwen3-30b-a3b-tp2-ep": (
        "qwen3-30b-a3b",
        dict(tensor_parallel_size=2, enable_expert_parallel=True),
    ),
}
# The flagship MoE shapes on 4 GPUs (issue 37): TP=4, TP=4 + EP, TP=4 + EP + an fp8 KV cache
# (MLA's latent cache for DeepSeek). Each also has a "-b1" form timing batch-1 decode alone on
# a small engine (for 4x H100, where ~59 GB of Qwen3-235B weights a GPU leave little room).
_EP = dict(enable_expert_parallel=True)
_VARIANTS = (("", {}), ("-ep", _EP), ("-ep-fp8kv", {**_EP, "kv_cache_dtype": "fp8"}))
for _shape in ("qwen3-235b-a22b-fp8", "deepseek-v3-40l", "deepseek-v3-24l"):
    for _suffix, _extra in _VARIANTS:
        ENGINE_CASES[f"{_shape}-tp4{_suffix}"] = (_shape, dict(tensor_parallel_size=4, **_extra))
        ENGINE_CASES[f"{_shape}-tp4{_suffix}-b1"] = ENGINE_CASES[f"{_shape}-tp4{_suffix}"]
# Cases that time batch-1 decode alone, on a small engine.
DECODE_ONLY = {name for name in ENGINE_CASES if name.endswith("-b1")}
# A case name + PEER_SUFFIX runs the case with the peer all-reduce (ATOM_ALLREDUCE=peer, the
# default) for small messages, the others on NCCL (ATOM_ALLREDUCE=nccl): run both in one call to
# compare (issue 36).
PEER_SUFFIX = "-peer"
for _name in [n for n, (_, p) in ENGINE_CASES.items() if p.get("tensor_parallel_size", 1) > 1]:
    ENGINE_CASES[_name + PEER_SUFFIX] = ENGINE_CASES[_name]
    if _name in DECODE_ONLY:
        DECODE_ONLY.add(_name + PEER_SUFFIX)


def shape_dir(name: str, smoke: bool) -> str:
    path = Path(tempfile.mkdtemp(prefix=f"atom-{name}-"))
    shape_config(name, smoke).save_pretrained(path)
    return str(path)


def engine_args(shape: str, args, small: bool = False, **parallel) -> dict:
    """The `EngineConfig` / `LLM` keyword arguments of a case (`small`: for batch-1 decode)."""
    cuda = torch.cuda.is_available()
    limits = (8, 1024, 1024) if small else (256, 8192, 4096)
    return dict(
        model=shape_dir(shape, args.smoke),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16" if cuda else "float32",
        device="cuda" if cuda else "cpu",
        max_num_seqs=limits[0],
        max_num_batched_tokens=limits[1],
        max_model_len=limits[2],
        **parallel,
    )


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def expert_split(engine) -> tuple[int, int, float]:
    """(rank 0's expert weight bytes, its other weight bytes, the hit share function's k / E)."""
    config = engine.hf_config
    experts = 0
    for name, p in engine.runner.model.named_parameters():
        if ".experts." in name:
            experts += p.numel() * p.element_size()
    total = weight_bytes(engine.runner.model)
    num = routed_experts(config)
    return experts, total - experts, (config.num_experts_per_tok / num if num else 0.0)


# The routed-expert count under each checkpoint family's name for it.
ROUTED_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def routed_experts(config) -> int:
    """Routed experts of a mixture-of-experts config (0 for a dense one): Qwen3-MoE's
    `num_experts`, DeepSeek / Kimi / GLM's `n_routed_experts`, Mixtral / GPT-OSS's
    `num_local_experts`."""
    for key in ROUTED_EXPERT_KEYS:
        value = getattr(config, key, None)
        if value:
            return int(value)
    return 0


def _device_us(event) -> float:
    """A profiler event's total device time in microseconds (`cuda_time_total` before torch
    renamed it)."""
    time_us = getattr(event, "device_time_total", None)
    return event.cuda_time_total if time_us is None else time_us


def collective_kernels(prof, steps: int, cuda: bool) -> dict:
    """Microseconds per step of each collective in a torch.profiler trace of `steps` steps: on a
    GPU its NCCL kernels' time (and all kernels' time), on the CPU gloo's ops' time."""
    out: dict[str, float] = {}
    gpu_total = 0.0
    kinds = (
        ("all_reduce", ("allreduce", "all_reduce")),
        ("all_gather", ("allgather", "all_gather")),
        ("broadcast", ("broadcast",)),
    )
    for event in prof.key_averages():
        name = event.key.lower()
        if cuda:  # kernels only: a CPU op's device time repeats its kernels'
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            time_us = _device_us(event)
            gpu_total += time_us
            if "nccl" not in name and "peer_all_reduce" not in name:
                continue
        elif name.startswith("gloo:"):
            time_us = event.cpu_time_total
        else:
            continue
        for kind, keys in kinds:
            if any(k in name for k in keys):
                out[f"{kind}_us_per_step"] = out.get(f"{kind}_us_per_step", 0.0) + time_us / steps
    if cuda:
        out["gpu_kernels_us_per_step"] = gpu_total / steps
        out.update(all_reduce_calls(prof, steps))
        out["top_kernels"] = top_kernels(prof, steps)
    return out


def top_kernels(prof, steps: int, count: int = 30) -> list[dict]:
    """Rank 0's kernels by time a step (issue 37's table of where a step goes): the name (cut to
    120 characters), launches a step, microseconds a step."""
    rows = []
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        time_us = _device_us(event)
        rows.append(
            dict(
                kernel=event.key[:120],
                calls_per_step=event.count / steps,
                us_per_step=time_us / steps,
            )
        )
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:count]


def all_reduce_calls(prof, steps: int) -> dict:
    """How rank 0's all-reduce kernel time per step is spread over its calls: the calls of a step
    by position (the i-th all-reduce of every step alike), each position's median over the steps
    summed (`median_sum_us_per_step`: a step's collective time without one-off waits), the first
    call's median (it absorbs the ranks' launch skew), and the quantiles of single calls. A call
    runs from its kernel's start to its end: with the ranks out of step, that includes waiting
    for the slowest."""
    spans = sorted(
        (event.time_range.start, event.time_range.elapsed_us())
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
        and (
            "peer_all_reduce" in event.name.lower()
            or ("nccl" in event.name.lower() and "allreduce" in event.name.lower())
        )
    )
    if not spans or len(spans) % steps:
        return {"all_reduce_calls": len(spans)}
    per_step = len(spans) // steps
    durations = [d for _, d in spans]
    by_position = [sorted(durations[i::per_step]) for i in range(per_step)]
    ordered = sorted(durations)

    def quantile(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return dict(
        all_reduce_calls_per_step=per_step,
        median_sum_us_per_step=sum(quantile(v, 0.5) for v in by_position),
        first_call_median_us=quantile(by_position[0], 0.5),
        call_us_min=ordered[0],
        call_us_p50=quantile(ordered, 0.5),
        call_us_p90=quantile(ordered, 0.9),
        call_us_max=ordered[-1],
    )


def bench_decode(
    engine, args, bandwidth: float | None, profile: bool, batches=(1, 8, 64)
) -> list[dict]:
    from atom_engine import SamplingParams

    results = []
    cuda = torch.cuda.is_available()
    experts, dense, k_over_e = expert_split(engine)
    per_token_kv = kv_bytes_per_token(engine)
    vocab = engine.hf_config.vocab_size
    steps = 4 if args.smoke else 48
    prompt_len = 32 if args.smoke else 512
    for bs in batches[:2] if args.smoke else batches:
        params = SamplingParams(temperature=0, max_tokens=2 * steps + 24, ignore_eos=True)
        for i, ids in enumerate(random_prompts(bs, prompt_len, vocab, seed=bs)):
            engine.add_request(f"{bs}-{i}", ids, params)
        while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
            engine.step()
        for _ in range(4):
            engine.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        step = (time.perf_counter() - t0) / steps
        row = dict(
            batch_size=bs,
            prompt_len=prompt_len,
            step_ms=step * 1e3,
            tokens_per_s=bs / step,
            decode_steps_timed=steps,
        )
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            try:  # the timings above stand without it
                with torch_profile(activities=activities) as prof:
                    for _ in range(steps // 2):
                        engine.step()
                    sync()
                row["profiled"] = collective_kernels(prof, steps // 2, cuda)
            except Exception as e:
                row["profiled"] = {"error": f"{type(e).__name__}: {e}"}
        assert len(engine.scheduler.running) == bs, "a sequence finished while being timed"
        while engine.has_unfinished_requests():
            engine.step()
        context = prompt_len + 4 + steps // 2  # the timed steps' mean
        hit = 1 - (1 - k_over_e) ** bs if experts else 0.0
        floor_bytes = dense + experts * hit + bs * context * per_token_kv
        row.update(
            weight_bytes=dense + experts,
            expert_bytes=experts,
            expert_share_hit=hit,
            kv_bytes=bs * context * per_token_kv,
            floor_bytes=floor_bytes,
        )
        if bandwidth:
            row["floor_ms"] = floor_bytes / bandwidth * 1e3
            row["fraction_of_bandwidth"] = row["floor_ms"] / row["step_ms"]
        print(
            f"  decode bs={bs}: {row['step_ms']:.2f} ms/step"
            + (
                f" (floor {row['floor_ms']:.2f} ms, {100 * row['fraction_of_bandwidth']:.0f}%)"
                if bandwidth
                else ""
            )
            + (
                ", profiled collectives "
                + str({k: v for k, v in row["profiled"].items() if k != "top_kernels"})
                if profile
                else ""
            ),
            flush=True,
        )
        results.append(row)
    return results


def workload_prompts(model: str, args) -> tuple[list[list[int]], list[int]]:
    """The offline 512-in / 256-out workload of random token ids: 256 requests (smoke: 8 of
    32 / 8 tokens)."""
    from atom_models import load_config

    vocab = load_config(model).vocab_size
    if args.smoke:
        return random_prompts(8, 32, vocab, seed=1), [8] * 8
    lengths = workload("512x256", 256)
    prompts = random_prompts(len(lengths), lengths[0][0], vocab, seed=1)
    return prompts, [o for _, o in lengths]


def rates(prompts, outs, elapsed: float) -> dict:
    """The offline workload's counts and tokens per second over `elapsed` seconds."""
    total_out, total_in = sum(outs), sum(len(p) for p in prompts)
    return dict(
        num_prompts=len(prompts),
        elapsed_s=elapsed,
        input_tokens=total_in,
        output_tokens=total_out,
        output_tok_per_s=total_out / elapsed,
        total_tok_per_s=(total_in + total_out) / elapsed,
    )


def throughput_result(engines, prompts, outs, elapsed, recorders, args) -> dict:
    """Tokens per second, and (dense models, with the roofline measured) the per-step roofline of
    each engine's own schedule; replicas run at once: the slowest replica's floor is the run's."""
    result = dict(
        **rates(prompts, outs, elapsed),
        steps=[len(r.steps) for r in recorders],
        num_preemptions=sum(e.scheduler.num_preemptions for e in engines),
        kv_cache_tokens=[e.runner.num_blocks * e.runner.block_size for e in engines],
    )
    if args.bandwidth and args.matmul and not expert_split(engines[0])[0]:
        floors = [
            sum(
                step_roofline(
                    r.steps,
                    e.runner.model,
                    e.hf_config,
                    kv_bytes_per_token(e),
                    args.bandwidth,
                    args.matmul,
                    e.config.tensor_parallel_size,
                )
            )
            for e, r in zip(engines, recorders, strict=True)
        ]
        result.update(step_roofline_s=max(floors), fraction_of_step_roofline=max(floors) / elapsed)
    print(
        f"  offline: {result['output_tok_per_s']:.0f} out tok/s ({elapsed:.1f} s)"
        + (
            f", per-step roofline {100 * result['fraction_of_step_roofline']:.0f}%"
            if "step_roofline_s" in result
            else ""
        ),
        flush=True,
    )
    return result


def bench_throughput(engine, args) -> dict:
    from atom_engine import SamplingParams

    prompts, outs = workload_prompts(engine.config.model, args)
    engine.add_request("warm", prompts[0][:64], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    recorder = StepRecorder(engine)
    sync()
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        params = SamplingParams(
            temperature=1.0, max_tokens=o, ignore_eos=True, output_kind="final_only"
        )
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    return throughput_result([engine], prompts, outs, time.perf_counter() - t0, [recorder], args)


def bench_data_parallel(llm, model: str, replicas: int, args) -> dict:
    """The offline workload through `LLM(data_parallel_size=N)`: one `generate` call of every
    request (the replicas, one engine process each, share them out), timed to its return."""
    from atom_engine import SamplingParams

    prompts, outs = workload_prompts(model, args)
    # one short request per replica first (requests are shared out by load)
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:64]}] * replicas, warm, use_tqdm=False)
    params = [SamplingParams(temperature=1.0, max_tokens=o, ignore_eos=True) for o in outs]
    sync()
    t0 = time.perf_counter()
    done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in done]
    assert produced == outs, "a request stopped short of its max_tokens"
    result = rates(prompts, outs, elapsed)
    print(f"  offline: {result['output_tok_per_s']:.0f} out tok/s ({elapsed:.1f} s)", flush=True)
    return result


def case_engine(name: str, args) -> dict:
    from atom_engine import LLM, EngineConfig, LLMEngine

    shape, parallel = ENGINE_CASES[name]
    # Read by each rank's EngineTPGroup (workers inherit it): NCCL unless the case says peer.
    os.environ["ATOM_ALLREDUCE"] = "peer" if name.endswith(PEER_SUFFIX) else "nccl"
    decode_only = name in DECODE_ONLY
    kwargs = engine_args(shape, args, small=decode_only, **parallel)
    t0 = time.perf_counter()
    if kwargs.get("data_parallel_size", 1) > 1:
        with LLM(**kwargs) as llm:
            start_s = time.perf_counter() - t0
            offline = bench_data_parallel(llm, kwargs["model"], kwargs["data_parallel_size"], args)
            return dict(shape=shape, **parallel, start_s=start_s, offline=offline)
    engine = LLMEngine(EngineConfig(**kwargs))
    try:
        start_s = time.perf_counter() - t0
        profile = engine.config.tensor_parallel_size > 1
        batches = (1,) if decode_only else (1, 8, 64)
        decode = bench_decode(engine, args, args.bandwidth, profile, batches)
        offline = None if decode_only else bench_throughput(engine, args)
        return dict(
            shape=shape,
            **parallel,
            all_reduce="peer" if name.endswith(PEER_SUFFIX) else "nccl",
            start_s=start_s,
            cuda_graphs=engine.runner.graphs is not None,
            async_scheduling=engine.async_scheduling,
            decode=decode,
            offline=offline,
        )
    finally:
        engine.shutdown()
