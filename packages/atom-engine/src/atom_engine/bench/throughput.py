"""`atom bench throughput`: offline generation throughput of the engine (`LLM.generate`).

Prompts go in as token ids (no tokenization inside the timed region) and every request ignores EOS,
so output lengths are exactly the requested ones. Sampling is temperature 1 (the full sampler runs),
as in vLLM's `benchmark_throughput`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from datetime import datetime

from atom_engine.bench import metrics
from atom_engine.bench.datasets import sample_requests
from atom_engine.config import EngineConfig


def format_report(result: dict) -> str:
    def row(label: str, value) -> str:
        return f"{label:<40} {value:.2f}" if isinstance(value, float) else f"{label:<40} {value}"

    return "\n".join(
        [
            " Offline Throughput Result ".center(50, "="),
            row("Requests:", result["num_requests"]),
            row("Elapsed time (s):", float(result["elapsed_time"])),
            row("Total input tokens:", result["total_input_tokens"]),
            row("Total output tokens:", result["total_output_tokens"]),
            row("Request throughput (req/s):", float(result["requests_per_second"])),
            row("Input token throughput (tok/s):", float(result["input_tokens_per_second"])),
            row("Output token throughput (tok/s):", float(result["output_tokens_per_second"])),
            row("Total token throughput (tok/s):", float(result["tokens_per_second"])),
            "=" * 50,
        ]
    )


def main(args, config: EngineConfig) -> dict:
    """Run the benchmark from parsed arguments and the engine's configuration."""
    from atom_engine import LLM

    llm = LLM(**asdict(config))
    try:
        return _run(llm, args)
    finally:
        llm.shutdown()


def _run(llm, args) -> dict:
    from atom_engine import SamplingParams

    engine = llm.engine
    seed = engine.config.seed
    dataset = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    output_len = args.output_len
    if output_len is None and dataset == "random":
        output_len = 128
    requests = sample_requests(
        dataset,
        llm.get_tokenizer(),
        args.num_prompts,
        args.input_len,
        output_len,
        args.range_ratio,
        args.dataset_path,
        seed,
        vocab_size=getattr(engine.hf_config, "vocab_size", None),
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=r.expected_output_len)
        for r in requests
    ]
    if args.num_warmups:
        llm.generate(prompts[: args.num_warmups], params[: args.num_warmups], use_tqdm=False)

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start

    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = metrics.throughput_summary(len(outputs), input_tokens, output_tokens, elapsed)
    print(format_report(result))
    if args.output_json:
        stats = engine.stats()
        payload = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "dataset_name": dataset,
            "dataset_path": args.dataset_path,
            "input_len": args.input_len,
            "output_len": output_len,
            "range_ratio": args.range_ratio,
            "num_warmups": args.num_warmups,
            **result,
            "engine_config": asdict(engine.config),
            "device": str(engine.config.resolved_device()),
            "resolved_dtype": str(engine.config.resolved_dtype()).removeprefix("torch."),
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"Saved {args.output_json}")
    return result
