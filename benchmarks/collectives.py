"""Collectives between two GPUs over the engine's own process group (EngineTPGroup: NCCL on
GPUs, gloo on the CPU), and each GPU's roofline: the `roofline` and `allreduce` cases of
multi_gpu.py.

- roofline: each GPU's copy bandwidth (read + write) and bf16 8192^3 matmul rate (kernels.py), and
  the GPU 0 -> GPU 1 copy rate;
- allreduce: the all-reduce of a [tokens, hidden] bf16 tensor, eager and inside a CUDA graph (as
  the decode graphs run it: 20 in one graph, replayed), at Llama-3-8B's and Qwen3-30B-A3B's
  hidden sizes; and the all-gather of the LM head's logits ([tokens, vocab / 2] per rank).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def case_roofline(args) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    from kernels import measure_roofline

    gpus = []
    for i in range(torch.cuda.device_count()):
        with torch.cuda.device(i):
            gpus.append(
                dict(device=i, name=torch.cuda.get_device_name(i), **measure_roofline(torch))
            )
    out = {"gpus": gpus}
    if torch.cuda.device_count() > 1:  # GPU 0 -> GPU 1 (NVLink), 1 GiB
        src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda:0")
        dst = torch.empty_like(src, device="cuda:1")
        for _ in range(3):
            dst.copy_(src)
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        sync()
        out["gpu0_to_gpu1_GBps"] = 10 * src.numel() * 2 / (time.perf_counter() - t0) / 1e9
    return out


def _time_us(fn, iters: int, cuda: bool) -> float:
    """Mean microseconds of `fn` run `iters` times back to back (CUDA events on a GPU)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def collective_rank(rank: int, port: int, smoke: bool, queue=None, store=None) -> None:
    """One rank of the collective timings (rank 0 passes its store and reports to `queue`)."""
    from atom_engine.parallel import EngineTPGroup, make_store

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tp = EngineTPGroup(store or make_store(rank, 2, port), rank, 2, device)
    iters = 5 if smoke else 200
    rows = []
    for shape in ("llama3-8b", "qwen3-30b-a3b"):
        config = shape_config(shape, smoke)
        for tokens in (1, 8, 64, 256, 2048):
            x = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16, device=device)
            tp.all_reduce(x)  # warm-up; the peers meet here
            row = dict(
                op="all_reduce",
                shape=shape,
                tokens=tokens,
                hidden=config.hidden_size,
                eager_us=_time_us(lambda x=x: tp.all_reduce(x), iters, cuda),
            )
            if cuda:  # as the decode graphs run it: 20 in one graph, replayed
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        tp.all_reduce(x)
                graph.replay()
                row["graph_us"] = _time_us(graph.replay, max(1, iters // 20), cuda) / 20
            rows.append(row)
        for tokens in (1, 8, 64):  # the LM head's logits, [tokens, vocab / 2] per rank
            x = torch.randn(tokens, config.vocab_size // 2, dtype=torch.bfloat16, device=device)
            tp.all_gather(x)
            rows.append(
                dict(
                    op="all_gather",
                    shape=shape,
                    tokens=tokens,
                    width=config.vocab_size // 2,
                    eager_us=_time_us(lambda x=x: tp.all_gather(x), iters, cuda),
                )
            )
    if queue is not None:
        queue.put(rows)


def case_allreduce(args) -> dict:
    import multiprocessing as mp

    from atom_engine.parallel import make_store

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        return {"skipped": "needs 2 GPUs"}
    ctx = mp.get_context("spawn")
    store = make_store(0, 2)  # rank 0 runs here; rank 1 joins its store
    queue = ctx.SimpleQueue()
    peer = ctx.Process(target=collective_rank, args=(1, store.port, args.smoke), daemon=True)
    peer.start()
    try:
        collective_rank(0, store.port, args.smoke, queue, store)
        rows = queue.get()
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()
    for row in rows:
        print(
            f"  {row['op']:10s} {row['shape']:14s} {row['tokens']:5d} tokens: "
            f"eager {row['eager_us']:8.1f} us"
            + (f", in a graph {row['graph_us']:7.1f} us" if "graph_us" in row else "")
        )
    return {"backend": "nccl" if torch.cuda.is_available() else "gloo", "results": rows}
