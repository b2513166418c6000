"""The tensor-parallel all-reduce on 2 / 4 GPUs: NCCL against the peer one-shot kernel, alone and
with the residual add + RMSNorm after it (issue 36).

    python benchmarks/allreduce.py --world 2 4 --out $OUT/allreduce-4xh200.json
    python benchmarks/allreduce.py --world 2 --smoke --out /tmp/ar.json   # 2 GPUs, few sizes
    python benchmarks/allreduce.py --world 2 --flashinfer --out $OUT/ar-fi.json   # issue 42

One process per GPU over the engine's own `EngineTPGroup` (its NCCL communicator and its
`PeerAllReduce`, here allowed every size: ATOM_ALLREDUCE_PEER_MAX_BYTES). For each [tokens, 4096]
bf16 message (8 KB at one token: Llama-3-8B's and Qwen3-235B's hidden size) it times, inside a CUDA
graph of 20 back-to-back calls as the decode graphs run them, replayed:
- `nccl`: NCCL's all-reduce; `peer`: the one-shot kernel; `peer2`: its two-shot form;
- `nccl+norm`: NCCL then the Triton `fused_add_rms_norm` (today's decoder layer); `peer+norm`:
  `all_reduce_add_rms_norm`, one kernel; `peer2+norm`: the same two-shot.
- with `--flashinfer` (FlashInfer installed: benchmarks/README.md "FlashInfer on the device"):
  `flashinfer+norm`, FlashInfer's fused all-reduce + residual add + RMSNorm (its TensorRT-LLM
  kernel through `flashinfer.comm.allreduce_fusion`, the one vLLM and SGLang fuse on NVIDIA),
  its output first checked against `peer+norm`'s on the same inputs (`flashinfer_max_abs_diff`).
The implementations alternate round after round (median of the rounds); rank 0's times are
reported.
"peer-copy" is the plain peer all-reduce again on a tensor NCCL's in-place calls never write;
`--each-slot` adds `peer/each` and `peer+norm/each`: the one-shot kernel's first form, every
rank's row through its slot and one slot polled at a time (`peer_all_reduce.EACH_SLOT`), where
the default sends to the peers only and polls them all at once; `--tokens 1 8` times those
sizes only.
`ALLREDUCE_ORDER=a,b,...` picks and orders the implementations (to tell a kernel's own time from
its place in the round).
`crossover_bytes` / `fused_crossover_bytes`: the largest size up to which `peer` beats `nccl`
(`peer+norm` beats `nccl+norm`) at every size, what `PEER_MAX_BYTES` in atom_engine/parallel.py is
set from; `two_shot_faster_bytes`: the sizes where `peer2` beat `peer` (`PEER_TWO_SHOT_BYTES`).
The first line of the JSON names the devices, torch and NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

HIDDEN = 4096
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
CALLS = 20  # per graph


def _graph(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (the Triton compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return graph


def _time_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * CALLS)


def _flashinfer(rank: int, world: int, port: int, max_tokens: int):
    """(flashinfer.comm, its TensorRT-LLM fusion workspace) over a torch.distributed group of its
    own (FlashInfer exchanges its buffers' handles through one)."""
    import torch.distributed as dist
    from flashinfer import comm

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))  # fmt: skip
    workspace = comm.create_allreduce_fusion_workspace(
        backend="trtllm", world_size=world, rank=rank, max_token_num=max_tokens,
        hidden_dim=HIDDEN, dtype=torch.bfloat16,
    )  # fmt: skip
    return comm, workspace


def _flashinfer_norm(fi, x, residual, weight):
    """FlashInfer's all_reduce(x) + residual -> RMSNorm: (normed, new residual), fresh outputs."""
    comm, workspace = fi
    norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)
    comm.allreduce_fusion(
        input=x, workspace=workspace, pattern=comm.AllReduceFusionPattern.kARResidualRMSNorm,
        launch_with_pdl=True, residual_out=residual_out, norm_out=norm_out, residual_in=residual,
        rms_gamma=weight, rms_eps=1e-6,
    )  # fmt: skip
    return norm_out, residual_out


def rank_main(
    rank: int,
    world: int,
    port: int,
    smoke: bool,
    out: str,
    fi_port: int | None = None,
    each_slot: bool = False,
    tokens_only: tuple[int, ...] = (),
) -> None:
    import faulthandler

    import atom_kernels
    from atom_engine.parallel import EngineTPGroup, make_store

    faulthandler.dump_traceback_later(150, exit=True)  # a rank stuck in a collective: its stack

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = EngineTPGroup(make_store(rank, world, port), rank, world, device)
    rounds, replays = (2, 5) if smoke else (7, 50)
    sizes = TOKENS[:4] if smoke else (tokens_only or TOKENS)
    fi = _flashinfer(rank, world, fi_port, max(sizes)) if fi_port else None
    rows = []
    for tokens in sizes:
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
        residual = torch.randn_like(x)
        weight = torch.rand(HIDDEN, dtype=torch.bfloat16, device=device) + 0.5

        def nccl(x=x):
            tp.pg.allreduce([x]).wait()

        def nccl_norm(x=x, residual=residual, weight=weight):
            tp.pg.allreduce([x]).wait()
            atom_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)

        impls = {"nccl": nccl, "nccl+norm": nccl_norm}
        if tp.peer is not None and tp.peer.fits(x):

            def peer(x=x):
                tp.peer.all_reduce(x)

            def peer_norm(x=x, residual=residual, weight=weight):
                tp.peer.all_reduce_add_rms_norm(x, residual, weight, 1e-6)

            x_copy = x.clone()  # never written by NCCL's in-place sums

            def peer_copy(x=x_copy):
                tp.peer.all_reduce(x)

            def peer2(x=x):
                tp.peer.all_reduce(x, two_shot=True)

            def peer2_norm(x=x, residual=residual, weight=weight):
                tp.peer.all_reduce_add_rms_norm(x, residual, weight, 1e-6, two_shot=True)

            impls.update({"peer": peer, "peer+norm": peer_norm, "peer-copy": peer_copy})
            impls.update({"peer2": peer2, "peer2+norm": peer2_norm})
            if each_slot:  # the first one-shot form, captured with EACH_SLOT (A/B)

                def each(fn):
                    def run():
                        from atom_kernels.backends.triton import peer_all_reduce

                        peer_all_reduce.EACH_SLOT = True
                        try:
                            fn()
                        finally:
                            peer_all_reduce.EACH_SLOT = False

                    return run

                impls.update({"peer/each": each(peer), "peer+norm/each": each(peer_norm)})
        agreement = {}
        if fi is not None:  # checked on fresh inputs before any timed call sums into x
            inputs = (x.clone(), residual.clone(), weight)
            ref, ref_residual = tp.all_reduce_add_rms_norm(*inputs, 1e-6)
            got, got_residual = _flashinfer_norm(fi, x.clone(), residual.clone(), weight)
            agreement = dict(
                flashinfer_max_abs_diff=float((got.float() - ref.float()).abs().max()),
                flashinfer_residual_max_abs_diff=float(
                    (got_residual.float() - ref_residual.float()).abs().max()
                ),
            )

            def fi_norm(x=x, residual=residual, weight=weight):
                _flashinfer_norm(fi, x, residual, weight)

            impls["flashinfer+norm"] = fi_norm
        order = os.environ.get("ALLREDUCE_ORDER")  # e.g. "peer-copy,nccl,peer,peer+norm"
        if order:
            impls = {name: impls[name] for name in order.split(",") if name in impls}
        graphs = {name: _graph(fn) for name, fn in impls.items()}
        times: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(rounds):  # alternated: every implementation once a round
            for name, graph in graphs.items():
                times[name].append(_time_us(graph, replays))
        row = dict(tokens=tokens, hidden=HIDDEN, bytes=x.nbytes, **agreement)
        row.update({f"{name}_us": statistics.median(t) for name, t in times.items()})
        rows.append(row)
        if rank == 0:
            print(
                f"  world {world} {x.nbytes:>9d} B: "
                + ", ".join(f"{k[:-3]} {v:7.1f} us" for k, v in row.items() if k.endswith("_us")),
                flush=True,
            )
        del graphs

    def crossover(peer: str, nccl: str) -> int:
        largest = 0
        for row in rows:
            if peer not in row or row[peer] >= row[nccl]:
                break
            largest = row["bytes"]
        return largest

    if rank == 0:
        result = dict(
            world=world,
            crossover_bytes=crossover("peer_us", "nccl_us"),
            fused_crossover_bytes=crossover("peer+norm_us", "nccl+norm_us"),
            # Where two-shot beat one-shot (PEER_TWO_SHOT_BYTES is set from these).
            two_shot_faster_bytes=[
                r["bytes"] for r in rows if "peer2_us" in r and r["peer2_us"] < r["peer_us"]
            ],
            results=rows,
        )
        Path(out).write_text(json.dumps(result, indent=2))
    torch.cuda.synchronize()
    if fi is not None:
        import torch.distributed as dist

        fi[1].destroy()
        dist.destroy_process_group()
    tp.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="four sizes, few rounds")
    parser.add_argument("--flashinfer", action="store_true", help="FlashInfer's fused kernel too")
    parser.add_argument(
        "--each-slot", action="store_true",
        help="also `peer/each`, `peer+norm/each`: the one-shot polling one peer at a time",
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="*", default=[], help="these sizes only")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from atom_engine.testing import free_port

    # Every size on the peer path, to find where it stops paying.
    os.environ["ATOM_ALLREDUCE"] = "peer"
    os.environ["ATOM_ALLREDUCE_PEER_MAX_BYTES"] = str(2 * TOKENS[-1] * HIDDEN * 2)
    record = dict(
        date=time.strftime("%Y-%m-%d"),
        devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        torch=torch.__version__,
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        calls_per_graph=CALLS,
        worlds=[],
    )
    for world in args.world:
        if world > torch.cuda.device_count():
            record["worlds"].append(dict(world=world, skipped="not enough GPUs"))
            continue
        part = f"{args.out}.world{world}"
        try:
            fi_port = free_port() if args.flashinfer else None
            mp.spawn(
                rank_main,
                args=(world, free_port(), args.smoke, part, fi_port, args.each_slot, args.tokens),
                nprocs=world,
            )
            record["worlds"].append(json.loads(Path(part).read_text()))
            Path(part).unlink()
        except Exception as e:  # the other worlds still run
            record["worlds"].append(dict(world=world, error=f"{type(e).__name__}: {e}"[:2000]))
        Path(args.out).write_text(json.dumps(record, indent=2))
    for result in record["worlds"]:
        if "crossover_bytes" in result:
            print(
                f"world {result['world']}: peer beats NCCL up to {result['crossover_bytes']} B, "
                f"fused with the norm up to {result['fused_crossover_bytes']} B"
            )


if __name__ == "__main__":
    main()
