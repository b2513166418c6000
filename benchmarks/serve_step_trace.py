"""`atom serve` under one `vllm bench serve` run, the engine's per-step log.

The server and the client as `vllm_plugin_cpu.py` runs them (its helpers: the same converted
SmolLM2-135M directory, float32, max_model_len 512, random 128 in / 64 out, ignore_eos), one
concurrency, with `ATOM_STEP_LOG` set for the server. The JSON keeps the client's metrics, the
load before and after, and the steps grouped by kind (decode-only at each batch size; steps with
prefill tokens by their prefill tokens, rounded down to 64): count, median and mean wall, median
engine-thread CPU, total seconds. `--keep-steps` also keeps every step.

    ~/.cache/atom-ci/vllm-0.32.0/bin/python benchmarks/serve_step_trace.py --concurrency 8 \
        --model-dir /tmp/atom-smollm2-hf --out benchmarks/results/serve-step-trace.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_plugin_cpu as bench  # noqa: E402  (its server and client helpers)


def kind(step: dict) -> str:
    if not step["prefill_tokens"]:
        return f"decode, batch {step['decode_rows']}"
    tokens = sum(step["prefill_tokens"]) // 64 * 64
    return f"prefill {tokens}+ tokens, {step['decode_rows']} one-token rows"


def summarize(steps: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for step in steps:
        groups.setdefault(kind(step), []).append(step)
    out = {}
    for name in sorted(groups):
        rows = groups[name]
        walls = [s["wall_ms"] for s in rows]
        out[name] = {
            "steps": len(rows),
            "median_wall_ms": round(statistics.median(walls), 1),
            "mean_wall_ms": round(statistics.mean(walls), 1),
            "median_cpu_ms": round(statistics.median(s["cpu_ms"] for s in rows), 1),
            "total_s": round(sum(walls) / 1e3, 2),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--atom-bin", default=str(bench.REPO / ".venv" / "bin" / "atom"))
    parser.add_argument("--label", default="", help="a name for this run in the JSON")
    parser.add_argument("--keep-steps", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="serve-step-trace-"))
    model_dir = bench.convert_smollm2(args.model_dir or work / "smollm2")
    step_log = work / "steps.jsonl"
    env = bench.server_env({})
    env["ATOM_STEP_LOG"] = str(step_log)  # server_env drops the caller's ATOM_* variables
    num_prompts = args.num_prompts or 4 * args.concurrency
    run = {"label": args.label, "load_before": bench.load()}
    proc, log, base, startup_s = bench.start_server(
        model_dir, env, work / "serve.log", [], args.atom_bin
    )
    try:
        run["startup_s"] = round(startup_s, 1)
        started = time.monotonic()
        run["bench"] = bench.bench(base, model_dir, args.concurrency, num_prompts, work)
        run["bench_s"] = round(time.monotonic() - started, 1)
    finally:
        bench.stop_server(proc, log)
    run["load_after"] = bench.load()
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    run["num_steps"] = len(steps)
    run["steps_by_kind"] = summarize(steps)
    if args.keep_steps:
        run["steps"] = steps
    result = json.loads(args.out.read_text()) if args.out.exists() else {
        "benchmark": "atom serve per-step log under vllm bench serve",
        "workload": {"input_len": 128, "output_len": 64, "ignore_eos": True,
                     "concurrency": args.concurrency, "num_prompts": num_prompts},
        "note": "steps include the client's warm-up requests (as many as the concurrency); "
        "wall_ms is the model run of a step, cpu_ms the engine thread's CPU time in it",
        "runs": [],
    }  # fmt: skip
    run["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["runs"].append(run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: run[k] for k in ("label", "load_before", "load_after", "steps_by_kind")},
                     indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
