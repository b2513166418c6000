"""How often greedy decoding on the bundled SmolLM2 keeps the same 32 tokens when only the numerics
change: the fp8 KV cache against the fp32 cache, next to a bf16 model against the fp32 one, and
K/V rounded through float8_e4m3fn (scale 1, or a per-call amax scale) into a full-precision cache.

    uv run python benchmarks/kv_fp8_agreement.py --out benchmarks/results/kv-fp8-agreement.json

Issue 14 asks the fp8 cache to keep the fp32 cache's 32 greedy tokens on at least 4 of 5 prompts;
this measures that bar against the model's own sensitivity (one process per configuration, CPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [  # the prompts of packages/atom-engine/tests/test_kv_cache_fp8.py
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old",
    "Q: What is the boiling point of water at sea level?\nA:",
]
CONFIGS = {  # name: (dtype, kv_cache_dtype, K/V rounding in front of the cache)
    "fp32": ("float32", "auto", None),
    "fp32-fp8cache": ("float32", "fp8", None),
    "bf16": ("bfloat16", "auto", None),
    "bf16-fp8cache": ("bfloat16", "fp8", None),
    "fp32-e4m3-rounded-scale1": ("float32", "auto", "one"),
    "fp32-e4m3-rounded-amax": ("float32", "auto", "amax"),
}


def run_one(name: str) -> list[list[int]]:
    import torch

    from atom_engine import LLM, SamplingParams
    from atom_models.layers import attention

    dtype, kv, rounding = CONFIGS[name]
    if rounding is not None:
        forward = attention.Attention.forward

        def rounded(x: torch.Tensor) -> torch.Tensor:
            scale = 1.0 if rounding == "one" else max(x.abs().max().item(), 1e-12) / 448.0
            return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale

        def patched(self, q, k, v, sinks=None):
            return forward(self, q, rounded(k), rounded(v), sinks)

        attention.Attention.forward = patched
    llm = LLM(dtype=dtype, device="cpu", max_num_batched_tokens=256, kv_cache_dtype=kv)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one configuration
    args = parser.parse_args()
    if args.one:
        Path(args.out).write_text(json.dumps(run_one(args.one)))
        return
    tokens = {}
    for name in CONFIGS:
        part = Path(args.out).with_suffix(f".{name}.tmp")
        subprocess.run([sys.executable, __file__, "--one", name, "--out", str(part)], check=True)
        tokens[name] = json.loads(part.read_text())
        part.unlink()

    def compare(a: str, b: str) -> dict:
        parted = [
            next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), None)
            for s, t in zip(tokens[a], tokens[b], strict=True)
        ]
        return {"equal": sum(p is None for p in parted), "parted_at": parted}

    pairs = [("fp32-fp8cache", "fp32"), ("bf16", "fp32"), ("bf16-fp8cache", "bf16")]
    pairs += [("fp32-e4m3-rounded-scale1", "fp32"), ("fp32-e4m3-rounded-amax", "fp32")]
    pairs += [("fp32-e4m3-rounded-scale1", "fp32-fp8cache")]
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prompts": PROMPTS,
        "max_tokens": 32,
        "comparisons": {f"{a} vs {b}": compare(a, b) for a, b in pairs},
        "tokens": tokens,
    }
    for key, value in result["comparisons"].items():
        print(f"{key}: {value['equal']} of {len(PROMPTS)} equal, parted at {value['parted_at']}")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
