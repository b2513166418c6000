"""Time from process start to the first token, by phase, with a cold and a warm Triton cache
(issue 41, item 4).

    python benchmarks/startup.py --shape qwen3-235b-a22b-fp8 --tp 4 --ep --out $OUT/startup.json
    python benchmarks/startup.py --smoke --shape llama3-8b --out /tmp/startup.json   # CPU, tiny

Each run is a fresh Python process timed from its launch by the parent: the interpreter's start,
the imports (torch, atom_engine), the engine's construction split into the phases of its start-up
line (front, workers, load, kv-cache, graphs, warm-up, other; `atom_engine/startup.py`), then one
128-token prompt's first token. Random weights (`load_format="dummy"`): the load phase here is
allocation and initialization, not reading a checkpoint (`load_bench.py` times that). The engine
is sized as `atom serve` sizes it by default (128 sequences, 2048 batched tokens on a GPU), with
a 4096-token context.

The runs, in order: `cold` with an empty TRITON_CACHE_DIR (every kernel compiled), then `warm`
(`--warm` times) with the cache the cold run filled. Triton compilation is cold minus warm, per
phase; the JSON also counts the kernels the cold run compiled.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH_ENV = "ATOM_BENCH_LAUNCH"  # the parent's time.time() at the child's launch
PROMPT_LEN = 128


def engine_log() -> list[str]:
    """A list that fills with the `atom_engine` logger's messages (INFO and up) from now on."""
    lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("atom_engine")
    logger.addHandler(Grab())
    logger.setLevel(logging.INFO)
    return lines


def startup_phases(lines: list[str]) -> tuple[str, dict[str, float]]:
    """The engine's start-up line among `lines` and its seconds by name ("startup": the total)."""
    line = next((entry for entry in lines if entry.startswith("startup ")), "")
    return line, {m[1]: float(m[2]) for m in re.finditer(r"([a-z-]+) ([0-9.]+) s", line)}


def child(args) -> None:
    """One start: print its times as a RESULT line of JSON."""
    main_at = time.time()
    launch = float(os.environ[LAUNCH_ENV])
    import torch

    from atom_engine import EngineConfig, LLMEngine, SamplingParams

    imported_at = time.time()
    lines = engine_log()
    cuda = torch.cuda.is_available()
    profiler = None
    if args.profile:  # rank 0's process (the workers are others): Python's profiler
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    engine = LLMEngine(
        EngineConfig(
            model=args.child,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16" if cuda else "float32",
            device="cuda" if cuda else "cpu",
            tensor_parallel_size=args.tp,
            enable_expert_parallel=args.ep,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=4096,
            show_progress=False,
        )
    )
    ready_at = time.time()
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
        Path(args.profile).write_text(text.getvalue())
    try:
        vocab = engine.hf_config.vocab_size
        prompt = [(7 * i + 11) % vocab for i in range(PROMPT_LEN)]
        engine.add_request("0", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        first_at = time.time()
    finally:
        engine.shutdown()
    line, phases = startup_phases(lines)
    phases.pop("startup", None)  # the total
    result = dict(
        interpreter_s=main_at - launch,
        imports_s=imported_at - main_at,
        engine_s=ready_at - imported_at,
        phases=phases,
        first_token_s=first_at - ready_at,
        total_s=first_at - launch,
        line=line,
    )
    print("RESULT " + json.dumps(result), flush=True)


def compiled_kernels(cache: Path) -> int:
    """The kernels in a Triton cache directory: one binary (cubin / hsaco) each."""
    return sum(1 for p in cache.rglob("*") if p.suffix in (".cubin", ".hsaco"))


def one_start(args, model: str, cache: Path, profile: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", model, "--tp", str(args.tp)]
    cmd += ["--profile", profile] if profile else []
    cmd += ["--ep"] if args.ep else []
    cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), LAUNCH_ENV: repr(time.time())}
    return run_child(cmd, env, args.timeout, tail=3000)


def run_child(cmd: list[str], env: dict, timeout: float, tail: int) -> dict:
    """Run a child process; its printed `RESULT <json>` line, or {"error": its output's tail}."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    result = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode or result is None:
        return {"error": (out.stderr or out.stdout)[-tail:]}
    return json.loads(result.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-235b-a22b-fp8")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--ep", action="store_true", help="enable_expert_parallel")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--warm", type=int, default=2, help="warm-cache starts after the cold one")
    parser.add_argument("--smoke", action="store_true", help="the shape's tiny stand-in (CPU)")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds a start may take")
    parser.add_argument(
        "--profile",
        help="after the timed starts, one more (warm) under cProfile: rank 0's engine "
        "construction, its 60 costliest calls (cumulative) written to this file",
    )
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from shapes import shape_config

    work = Path(tempfile.mkdtemp(prefix="atom-startup-"))
    model = work / "model"
    shape_config(args.shape, args.smoke).save_pretrained(model)
    cache = work / "triton-cache"
    cuda = torch.cuda.is_available()
    record = dict(
        date=time.strftime("%Y-%m-%d"),
        torch=torch.__version__,
        devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else ["cpu"],
        shape=args.shape + (" (smoke)" if args.smoke else ""),
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.ep,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        runs=[],
    )
    for i in range(1 + args.warm):
        result = one_start(args, str(model), cache)
        result["triton_cache"] = "cold" if i == 0 else "warm"
        if i == 0:
            result["kernels_compiled"] = compiled_kernels(cache)
        record["runs"].append(result)
        print({k: v for k, v in result.items() if k != "line"}, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(record, indent=2))
    if args.profile:
        result = one_start(args, str(model), cache, args.profile)
        print("profiled start:", {k: v for k, v in result.items() if k != "line"}, flush=True)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
