"""Split-K's finish for the integer GEMMs (``int_quant``, ``int_quant_frag``): each split stores
its partial, the last to arrive sums them in split order (the same sum on every run)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _split_k_sum(acc, ws_ptr, count_ptr, offs_m, offs_n, M, N, SPLIT_K: tl.constexpr):
    """Stores this split's partial in the workspace [SPLIT_K, M, N] and counts in on the tile's
    counter; returns (the splits' sum in split order, the tile's output mask: empty unless this
    program arrived last, the one that finishes the tile and sets the counter back to zero)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tile = offs_m[:, None] * N + offs_n[None, :]
    return _split_k_sum_flat(acc, ws_ptr, count_ptr, tile, mask, M * N, SPLIT_K)


@triton.jit
def _split_k_sum_flat(acc, ws_ptr, count_ptr, offsets, mask, size, SPLIT_K: tl.constexpr):
    """``_split_k_sum`` of a flat partial: ``acc`` [B] at ``offsets`` into each split's [size]
    of the workspace [SPLIT_K, size], counted on program_id(0)'s counter; returns (the sum, the
    mask: empty unless this program arrived last)."""
    tl.store(ws_ptr + tl.program_id(1) * size + offsets, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial stored before the release below
    counter = count_ptr + tl.program_id(0)
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.zeros_like(acc)
    mask = mask & (offsets * 0 + last.to(tl.int32) != 0)  # a tensor mask (the interpreter)
    if last:
        for s in range(SPLIT_K):  # split order: the same sum on every run
            total += tl.load(ws_ptr + s * size + offsets, mask=mask, other=0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)  # ready for the next call (and graph replay)
    return total, mask
