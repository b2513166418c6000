"""Where the host time of a large-batch decode step goes, on the CPU, with the forward excluded.

    python benchmarks/host_step.py --batch-size 256 --out x.json

A tiny random Qwen3 (one layer, hidden 32, vocabulary 512) runs the engine's async-scheduling path
on the CPU: the same host work as a decode step on the GPU (schedule, the launch's inputs, the
decode graphs' host staging, the placeholders, the previous launch's completion) with a forward
that costs little. The decode graphs are the real `DecodeGraphs` with each capture replaced by the
eager forward over the graphs' static buffers (so the staging is exercised, and checked: the
forward reads only what the staging wrote), pinned memory by pageable memory.

Each phase is timed with `time.perf_counter` around its call; ``forward`` (the fake replay and
the LM head) and ``sample_device`` (the sampling kernels) are the device's work on a GPU and are
left out of ``host_us``. Reported per step and per sequence, the median over `--steps` steps.
The workload's sampling is the nano-vllm workload's (temperature 1.0, final_only outputs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections import defaultdict
from unittest import mock

import torch


class _Timers:
    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)
        step = self.step

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                step[phase] += time.perf_counter() - t0

        setattr(owner, name, timed)


def _tiny_model(path: str) -> None:
    from transformers import Qwen3Config

    from atom_models.testing import save_random_checkpoint

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    save_random_checkpoint(config, path)


def run(args) -> dict:
    from atom_engine import EngineConfig, LLMEngine, SamplingParams
    from atom_engine.testing import eager_decode_graphs

    bs = args.batch_size
    with tempfile.TemporaryDirectory() as path:
        _tiny_model(path)
        # Sequences decode from their prefill's step on (16 prompts a step): room for those.
        max_tokens = args.warmup + args.steps + bs * args.prompt_len // 8192 + 16
        blocks_per_seq = -(-(args.prompt_len + max_tokens + 16) // 16)
        engine = LLMEngine(
            EngineConfig(
                model=path,
                skip_tokenizer_init=True,
                dtype="float32",
                device="cpu",
                enforce_eager=True,
                async_scheduling=True,
                max_num_seqs=bs,
                max_num_batched_tokens=8192,
                max_model_len=4096,
                num_kv_blocks=bs * blocks_per_seq + 64,
                num_threads=1,
            )
        )
    timers = _Timers()
    eager_decode_graphs(engine.runner, lambda dt: timers.step.__setitem__("forward", dt))
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind="final_only",
    )
    for i in range(bs):
        prompt = [(7 * i + j) % 500 for j in range(args.prompt_len)]
        engine.add_request(str(i), prompt, params)
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    runner = engine.runner
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine, "_mark_scheduled", "mark_scheduled")
    timers.wrap(runner, "launch", "launch")
    timers.wrap(runner, "_prepare", "prepare")
    timers.wrap(runner.graphs.decode, "run", "graph_run")
    timers.wrap(runner, "_logits", "logits")
    timers.wrap(runner.sampler, "sample_on_device", "sample")
    timers.wrap(runner.model, "compute_logits", "lm_head")
    timers.wrap(engine, "_advance", "advance")
    timers.wrap(engine, "_complete_pending", "complete_pending")
    sample_kernel = mock.patch("atom_kernels.sample", _timed_kernel(timers))
    per_step: list[dict[str, float]] = []
    with sample_kernel if args.temperature > 0 else contextlib.nullcontext():
        for _ in range(args.steps):
            timers.step.clear()
            t0 = time.perf_counter()
            engine.step()
            timers.step["step"] = time.perf_counter() - t0
            if len(engine._pending.batch) != bs:
                raise RuntimeError(f"a timed step ran {len(engine._pending.batch)} sequences")
            per_step.append(dict(timers.step))
    if any("graph_run" not in s for s in per_step):
        raise RuntimeError("a timed step did not run the decode graphs")
    return _report(per_step, bs, args)


def _timed_kernel(timers: _Timers):
    import atom_kernels

    real = atom_kernels.sample

    def sample(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            timers.step["sample_device"] += time.perf_counter() - t0

    return sample


def _report(per_step: list[dict[str, float]], bs: int, args) -> dict:
    # Nested phases: launch holds prepare, graph_run (holding forward), the LM head and sample
    # (holding sample_device); the step holds everything. Each phase is the median of
    # its per-step times; the host time is their sum (the machine is shared: a median per phase
    # is steadier than the median of a whole step less its device parts).
    def phase(s: dict[str, float]) -> dict[str, float]:
        g = s.get
        return {
            "schedule": g("schedule", 0),
            "mark_scheduled": g("mark_scheduled", 0),
            "prepare": g("prepare", 0),
            "graph_staging": g("graph_run", 0) - g("forward", 0),
            "sample_host": g("sample", 0) - g("sample_device", 0),
            "launch_other": g("launch", 0)
            - g("prepare", 0)
            - g("graph_run", 0)
            - g("sample", 0)
            - g("lm_head", 0),
            "advance": g("advance", 0),
            "complete_pending": g("complete_pending", 0),
            "step_other": g("step", 0)
            - sum(g(k, 0) for k in ("schedule", "mark_scheduled", "launch"))
            - sum(g(k, 0) for k in ("advance", "complete_pending")),
        }

    rows = [phase(s) for s in per_step]
    phases = {k: statistics.median(r[k] for r in rows) * 1e6 for k in rows[0]}
    device = {
        k: statistics.median(s.get(k, 0) for s in per_step) * 1e6
        for k in ("forward", "lm_head", "sample_device")
    }
    host_us = sum(phases.values())
    return {
        "batch_size": bs,
        "prompt_len": args.prompt_len,
        "temperature": args.temperature,
        "steps": args.steps,
        "torch_threads": torch.get_num_threads(),
        "host_us_per_step": round(host_us, 1),
        "host_us_per_seq": round(host_us / bs, 3),
        "step_us_per_step": round(statistics.median(s["step"] for s in per_step) * 1e6, 1),
        "phases_us_per_seq": {k: round(v / bs, 3) for k, v in phases.items()},
        "device_us_per_step": {k: round(v, 1) for k, v in device.items()},
        "label": args.label,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
