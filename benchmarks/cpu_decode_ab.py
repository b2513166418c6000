"""In one engine, A/B of the CPU decode step's two session-11 paths (issue 21), alternating.

- `gemm`: 1-row GEMMs on the transposed copies (`onednn_linear.pack_one_row`) or on `F.linear`;
- `attn`: decode-only steps through `DecodeStep` (the caches' slot views kept) or the cpu
  backend's ops every layer.

One `atom_engine.LLM` (SmolLM2-135M converted, float32, compiled forward, 1 thread); a decode step
is (generate to 1 + N tokens - generate to 1 token) / N for B prompts of 128 random tokens; the
four modes alternate within each repeat, so a load change hits all of them. Greedy tokens are
compared across modes. JSON to --out with the load before and after.

    uv run python benchmarks/cpu_decode_ab.py --out benchmarks/results/cpu-decode-ab-s11.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from atom_engine import LLM, SamplingParams
from atom_kernels.backends.cpu import onednn_linear
from atom_models.native_host import NativeAttention

MODES = ("base", "gemm", "attn", "both")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/atom-smollm2-hf"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    load_before = os.getloadavg()
    llm = LLM(str(args.model_dir), dtype="float32", max_model_len=1024, num_threads=1)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, NativeAttention)]
    slots = {id(m): m._decode_slots for m in layers}
    one_row = dict(onednn_linear._ONE_ROW)

    def set_mode(mode: str) -> None:
        onednn_linear._ONE_ROW = one_row if mode in ("gemm", "both") else {}
        for m in layers:
            m._decode_slots = slots[id(m)] if mode in ("attn", "both") else None

    def generate(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        started = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - started, [o.outputs[0].token_ids for o in outs]

    g = torch.Generator().manual_seed(0)
    results: dict = {}
    for batch in args.batch_sizes:
        prompts = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(batch)]
        steps = {m: [] for m in MODES}
        tokens = {}
        for mode in MODES:  # warm-up
            set_mode(mode)
            generate(prompts, 2)
        for _ in range(args.repeats):
            for mode in MODES:
                set_mode(mode)
                short, _ = generate(prompts, 1)
                long, toks = generate(prompts, 1 + args.decode_steps)
                steps[mode].append((long - short) / args.decode_steps * 1e3)
                tokens[mode] = toks
        results[str(batch)] = {
            m: {
                "step_ms_median": round(statistics.median(v), 2),
                "step_ms": [round(x, 2) for x in v],
            }
            for m, v in steps.items()
        }
        results[str(batch)]["greedy_equal"] = all(tokens[m] == tokens["base"] for m in MODES)
        print(batch, {m: results[str(batch)][m]["step_ms_median"] for m in MODES},
              "greedy equal", results[str(batch)]["greedy_equal"], flush=True)  # fmt: skip
    set_mode("both")
    out = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["results"]))


if __name__ == "__main__":
    main()
