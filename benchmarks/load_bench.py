"""Checkpoint loading at the disk's speed (issue 41, item 3): load time against the machine's raw
read and host-to-device copy rates, measured in the same call.

    python benchmarks/load_bench.py --out $OUT/load.json [--dir /tmp/atom-load] [--tp 1 2]
    python benchmarks/load_bench.py --smoke --out /tmp/load-smoke.json   # CPU, tiny

The benchmark writes its own real-format checkpoints (random values) to `--dir`: the Llama-3-8B
shape in bf16 (~16 GB) and in block FP8 (`quant_method: fp8`, 128x128 blocks, ~8.5 GB), as
safetensors shards of at most 4 GiB. Then, per checkpoint:
- raw read: every shard read sequentially in 64 MiB chunks, cold (each file's pages dropped from
  the page cache first with posix_fadvise DONTNEED) and warm (from the page cache);
- host-to-device copy: 1 GiB from pinned and from pageable host memory;
- load: each tensor-parallel size in a fresh process (`atom_engine.LLM` with
  `load_format="safetensors"`, eager, a small KV cache; its start-up line's "load" phase, rank
  0's), cold and warm as above, with `ATOM_SAFETENSORS_DIRECT` 1 and 0 alternated (the direct
  file -> pinned -> GPU reader against mmap'd CPU tensors; TP > 1 reads by range either way).
  GB/s is the checkpoint's bytes over the load phase's seconds.
- `--reader-sweep` (a GPU): first the direct reader alone (no model: every tensor read to the
  device and dropped, the pinned chunks allocated afresh each time) on the warm bf16 checkpoint
  for each `threads:chunk MiB:ring chunks` of `SWEEP`, alternated, best of two rounds, and the
  page cache's own rate read by 1-16 threads with `preadv` (no GPU); then the loads alternate
  the default reader with the sweep's fastest
  (`--readers` names readers explicitly instead).
- `--register-probe` (a GPU): whether the GPU can copy straight from the page cache
  (`cudaHostRegister` of a warm shard's mapping; no pinned copy): `register_probe`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from load_readers import (  # noqa: E402
    DEFAULT_READER,
    raw_read_gbps,
    reader_sweep,
    register_probe,
    set_reader,
)
from shapes import shape_config  # noqa: E402
from startup import engine_log, run_child, startup_phases  # noqa: E402

SHARD_BYTES = 4 << 30


def checkpoint_tensors(config, fp8: bool, device: str):
    """(name, tensor) of a random checkpoint of `config` (HF names), made on `device`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, param in model.state_dict().items():
        w = torch.randn(param.shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
        if fp8 and name.endswith("_proj.weight") and ".layers." in name:
            n, k = w.shape
            yield name, w.to(torch.float8_e4m3fn).cpu()
            scale = torch.full((-(-n // 128), -(-k // 128)), 1.0, dtype=torch.float32)
            yield name.removesuffix("weight") + "weight_scale_inv", scale
        else:
            yield name, w.cpu()


def write_checkpoint(path: Path, config, fp8: bool, device: str) -> int:
    """Write the checkpoint in shards (skipped when `path` already holds it); its bytes."""
    from safetensors.torch import save_file

    done = path / "done.json"
    if done.exists():
        return json.loads(done.read_text())["bytes"]
    path.mkdir(parents=True, exist_ok=True)
    if fp8:
        config.quantization_config = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    config.save_pretrained(path)
    shard, shard_bytes, total, index = {}, 0, 0, 0
    weight_map = {}

    def flush():
        nonlocal shard, shard_bytes, index
        index += 1
        file = f"model-{index:05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        shard, shard_bytes = {}, 0

    for name, tensor in checkpoint_tensors(config, fp8, device):
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += size
        total += size
    flush()
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index_json))
    done.write_text(json.dumps({"bytes": total}))
    return total


def drop_cache(path: Path) -> None:
    """Evict the checkpoint's files from the page cache (clean pages: no privileges needed)."""
    for f in sorted(path.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def h2d_gbps(pinned: bool) -> float | None:
    if not torch.cuda.is_available():
        return None
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dev.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return host.numel() / best / 1e9


def load_child(path: str, tp: int, smoke: bool, reader: str) -> None:
    """A child process: start an engine on the checkpoint; print its start-up phases as JSON."""
    from atom_engine import LLM

    set_reader(reader)
    lines = engine_log()
    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    llm = LLM(
        model=path,
        tensor_parallel_size=tp,
        load_format="safetensors",
        dtype="bfloat16" if cuda else "float32",
        device="cuda" if cuda else "cpu",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=4,
        show_progress=False,
        **({"gpu_memory_utilization": 0.5} if cuda else {}),
    )
    ready = time.perf_counter() - start
    runner = getattr(llm.engine, "runner", None)  # TP=1: in this process, unrounded phases
    exact = dict(getattr(getattr(runner, "startup", None), "phases", {}) or {})
    llm.shutdown()
    line, phases = startup_phases(lines)
    result = {"ready_s": ready, "line": line, "phases": phases, "phases_exact": exact}
    print("RESULT " + json.dumps(result), flush=True)


def timed_load(path: Path, tp: int, smoke: bool, cold: bool, direct: str, reader: str) -> dict:
    if cold:
        drop_cache(path)
    else:
        raw_read_gbps(path)  # into the page cache
    cmd = [sys.executable, __file__, "--child", str(path), "--tp", str(tp), "--readers", reader]
    cmd += ["--smoke"] if smoke else []
    env = {**os.environ, "ATOM_SAFETENSORS_DIRECT": direct}
    return run_child(cmd, env, 600, tail=2000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--dir", default="/tmp/atom-load")
    parser.add_argument("--tp", nargs="*", type=int, default=[1, 2], help="none: no loads")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    parser.add_argument(
        "--direct",
        nargs="+",
        default=["1", "0"],
        choices=["1", "0", "register"],
        help="ATOM_SAFETENSORS_DIRECT values to alternate (1: file -> pinned -> GPU; register: "
        "DMA from the registered page cache; 0: mmap)",
    )
    parser.add_argument(
        "--readers",
        nargs="+",
        default=[DEFAULT_READER],
        help="direct readers (threads:chunk MiB:ring chunks) the loads alternate",
    )
    parser.add_argument(
        "--checkpoints",
        nargs="+",
        default=["llama3-8b-bf16", "llama3-8b-fp8-block"],
        choices=["llama3-8b-bf16", "llama3-8b-fp8-block"],
    )
    parser.add_argument(
        "--register-probe", action="store_true", help="DMA from the page cache, one shard"
    )
    parser.add_argument("--reader-sweep", action="store_true", help="time readers alone first")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        load_child(args.child, args.tp[0], args.smoke, args.readers[0])
        return
    cuda = torch.cuda.is_available()
    record = dict(
        date=time.strftime("%Y-%m-%d"),
        torch=torch.__version__,
        device=torch.cuda.get_device_name(0) if cuda else "cpu",
        gpus=torch.cuda.device_count(),
        h2d_pinned_gbps=h2d_gbps(True),
        h2d_pageable_gbps=h2d_gbps(False),
        checkpoints={},
    )
    tps = [tp for tp in args.tp if not cuda or tp <= torch.cuda.device_count()]
    readers = list(args.readers)
    for label, fp8 in (("llama3-8b-bf16", False), ("llama3-8b-fp8-block", True)):
        if label not in args.checkpoints:
            continue
        if fp8 and not cuda:
            continue  # the CPU smoke run: FP8 weights need a GPU to compute
        config = shape_config("llama3-8b", args.smoke)
        path = Path(args.dir) / label
        start = time.perf_counter()
        size = write_checkpoint(path, config, fp8, "cuda" if cuda else "cpu")
        entry = dict(bytes=size, write_s=time.perf_counter() - start)
        drop_cache(path)
        entry["raw_read_cold_gbps"] = raw_read_gbps(path)
        entry["raw_read_warm_gbps"] = raw_read_gbps(path)
        if args.register_probe and cuda and not fp8:
            entry["register_probe"] = register_probe(path)
        if args.reader_sweep and cuda and not fp8:
            entry["sweep"] = reader_sweep(path, size)
            if entry["sweep"]["fastest"] not in readers:
                readers.append(entry["sweep"]["fastest"])
        ways = [("0", DEFAULT_READER)] if "0" in args.direct else []
        ways = [("1", r) for r in readers] * ("1" in args.direct) + ways
        ways = [("register", DEFAULT_READER)] * ("register" in args.direct) + ways
        for tp in tps:
            for cold, (direct, reader) in [(c, w) for c in (True, False) for w in ways]:
                key = f"tp{tp}_{'cold' if cold else 'warm'}_direct{direct}"
                key += f"_r{reader}" if direct == "1" and reader != DEFAULT_READER else ""
                result = timed_load(path, tp, args.smoke, cold, direct, reader)
                exact = result.get("phases_exact", {}).get("load")
                load_s = exact or result.get("phases", {}).get("load")
                if load_s:
                    result["load_gbps"] = size / load_s / 1e9
                entry[key] = result
                print(label, key, {k: v for k, v in result.items() if k != "line"}, flush=True)
        record["checkpoints"][label] = entry
        if args.out:
            Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
