"""The ranks of test_multi_gpu_all_reduce.py: `python all_reduce_ranks.py <world>` spawns one
process per GPU; each builds the engine's `EngineTPGroup` (NCCL + the peer one-shot all-reduce)
and checks, for every message the engine sends (tokens x hidden of the decode graphs and prefill
chunks, bf16 and fp32):

- `all_reduce` bitwise against the ranks' parts (all-gathered) summed in fp32 in rank order and
  rounded once (what the kernel computes), and against NCCL's all-reduce within the rounding of
  the sum (NCCL rounds its partial sums: a bf16 ulp or two of the message's largest value);
- `all_reduce_add_rms_norm` against that sum + the reference `fused_add_rms_norm` (the residual
  bitwise, the norm within bf16's rounding, fp32 within 1e-5) and against NCCL + the reference,
  eagerly and replayed from a CUDA graph (twice, new inputs copied in: both halves of the
  staging buffer);
- the two-shot form (`two_shot=True`, each rank sums a share of the rows) of both, eagerly, on
  every message the peer buffer fits, whichever form the engine picks for it: the same checks;
- every rank gets the same bits (all-gathered over NCCL).

Exits non-zero (a rank's exception) on the first mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.multiprocessing as mp

TOKENS = (1, 3, 8, 64, 256, 512, 2048)
HIDDEN = (512, 4096, 7168)
EPS = 1e-6


def _inputs(rank: int, tokens: int, hidden: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype).to(device)
    g = torch.Generator().manual_seed(seed)  # the same residual and weight on every rank
    residual = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(device)
    return x, residual, weight


def _check_close(got, want, dtype, what: str, loose: bool = False) -> None:
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    if loose and dtype != torch.float32:  # a norm of sums that differ by NCCL's rounding
        atol = rtol = 1e-1
    if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
        diff = (got.float() - want.float()).abs().max().item()
        raise AssertionError(f"{what}: max |diff| {diff:.3g} over atol {atol} / rtol {rtol}")


def _check_equal(got, want, what: str) -> None:
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal (max |diff| {diff:.3g})")


def _gather(tp, t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    tp._group().allgather([parts], [t.contiguous()]).wait()
    return parts


def _same_on_every_rank(tp, t: torch.Tensor, what: str) -> None:
    for r, part in enumerate(parts := _gather(tp, t)):
        if not torch.equal(part, parts[0]):
            raise AssertionError(f"{what}: rank {r}'s result differs from rank 0's")


def _references(tp, x, residual, weight):
    """(exact sum, NCCL's sum, reference fused op on each, the rounding allowed against NCCL)."""
    from atom_kernels.backends.torch.norm import fused_add_rms_norm

    exact = sum(p.float() for p in _gather(tp, x)).to(x.dtype)
    nccl = x.clone()
    tp._group().allreduce([nccl]).wait()
    ulps = 2.0 ** -(7 if x.dtype == torch.bfloat16 else 23) * (tp.size - 1)
    slack = ulps * exact.float().abs().max().item() * 2
    return (
        exact,
        nccl,
        fused_add_rms_norm(exact, residual, weight, EPS),
        fused_add_rms_norm(nccl, residual, weight, EPS),
        slack,
    )


def _check_fused(got, refs, dtype, what: str) -> None:
    out, new_residual = got
    _, _, (want, want_residual), (nccl_out, nccl_residual), slack = refs
    _check_equal(new_residual, want_residual, f"{what} residual")
    _check_close(out, want, dtype, f"{what} normed")
    if (new_residual.float() - nccl_residual.float()).abs().max().item() > slack:
        raise AssertionError(f"{what}: residual beyond NCCL's rounding (slack {slack:.3g})")
    _check_close(out, nccl_out, dtype, f"{what} normed against NCCL's", loose=True)


def rank_main(rank: int, world: int, port: int) -> None:
    import os

    from atom_engine.parallel import EngineTPGroup, make_store

    os.environ["ATOM_ALLREDUCE"] = "peer"
    # Every message here on the peer path (the engine's limits are per size: PEER_MAX_BYTES).
    os.environ["ATOM_ALLREDUCE_PEER_MAX_BYTES"] = str(16 << 20)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = EngineTPGroup(make_store(rank, world, port), rank, world, device)
    assert tp.peer is not None, "no peer all-reduce on GPUs that should have it"
    checked = two_shot_checked = 0
    for dtype in (torch.bfloat16, torch.float32):
        for hidden in HIDDEN:
            for tokens in TOKENS:
                seed = tokens * 7 + hidden
                x, residual, weight = _inputs(rank, tokens, hidden, dtype, device, seed)
                what = f"world {world} {dtype} [{tokens}, {hidden}] ({x.nbytes} B)"
                refs = _references(tp, x, residual, weight)
                exact, nccl, _, _, slack = refs
                got = tp.all_reduce(x.clone())
                if x.nbytes <= tp.peer_max_bytes and tp.peer.fits(x):  # else NCCL's
                    _check_equal(got, exact, f"{what} all_reduce")
                if (got.float() - nccl.float()).abs().max().item() > slack:
                    raise AssertionError(f"{what} all_reduce beyond NCCL's rounding")
                _same_on_every_rank(tp, got, f"{what} all_reduce")
                fused = tp.all_reduce_add_rms_norm(x.clone(), residual, weight, EPS)
                if x.nbytes <= tp.peer_fused_max_bytes and tp.peer.fits(x):
                    _check_fused(fused, refs, dtype, what)
                _same_on_every_rank(tp, fused[0], f"{what} normed")
                if tp.peer.fits(x):  # the two-shot form, whether or not the engine picks it
                    two = tp.peer.all_reduce(x.clone(), two_shot=True)
                    _check_equal(two, exact, f"{what} two-shot all_reduce")
                    two = tp.peer.all_reduce_add_rms_norm(
                        x.clone(), residual, weight, EPS, two_shot=True
                    )
                    _check_fused(two, refs, dtype, f"{what} two-shot")
                    two_shot_checked += 1

                # In a CUDA graph, as the engine's decode graphs run it (3 per graph).
                static_x = x.clone()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    tp.all_reduce_add_rms_norm(static_x.clone(), residual, weight, EPS)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = [
                        tp.all_reduce_add_rms_norm(static_x.clone(), residual, weight, EPS)
                        for _ in range(3)
                    ]
                for replay in range(2):
                    fresh, _, _ = _inputs(rank, tokens, hidden, dtype, device, seed + replay + 1)
                    static_x.copy_(fresh)
                    graph.replay()
                    refs = _references(tp, fresh, residual, weight)
                    for fused in outs:
                        if x.nbytes <= tp.peer_fused_max_bytes and tp.peer.fits(x):
                            _check_fused(fused, refs, dtype, f"{what} graph replay {replay}")
                        else:
                            _check_close(fused[0], refs[3][0], dtype, f"{what} graph (NCCL)")
                torch.cuda.synchronize()
                del graph
                checked += 1
    if rank == 0:
        print(
            f"world {world}: {checked} message shapes checked ({two_shot_checked} two-shot too), "
            f"peer max {tp.peer.max_bytes} B"
        )
    tp.close()


def main() -> None:
    from atom_engine.testing import free_port

    world = int(sys.argv[1])
    mp.spawn(rank_main, args=(world, free_port()), nprocs=world, join=True)


if __name__ == "__main__":
    main()
