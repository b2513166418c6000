"""Triton greedy argmax over a step's logits: the ``greedy_argmax`` op's GPU path.

A greedy decode step ends with the argmax of its [B, V] logits. torch's reduction runs one row
on few blocks: 38 us a step for Llama-3-8B's 128,256 logits at batch 1 on an H100 (results/
s11-h100/call5/profile-decode-llama-bs1-call5.json, the ``ArgMaxOps`` kernel after each graph
replay), against ~0.1 us of bytes. ``_argmax_kernel`` splits each row over about two programs
per SM; each writes its chunk's best (value, index) and first NaN, then counts itself in on its
row's counter (acquire/release), and the program that arrives last merges the row's partials,
writes the token id and sets the counter back to zero (as the split-K GEMM, ``linear.py``), so
it is one launch. With programmatic dependent launch (``pdl.py``) it launches behind the LM head
and waits before its first read.

torch's semantics, exactly: the largest value, ties to the lowest index, and a NaN anywhere
wins (the first NaN's index, as torch.argmax); a row of -inf gives 0.
On by default; ``ATOM_TRITON_ARGMAX=0`` gives torch's argmax (A/B).

NOTE (H100, 2026-11-24, results/s12-h100/final-call8..11, s13-h100/call1-2): session 12 turned it
off after the GPU engine suite faulted (illegal memory access) with it on. The fault was not
here: CUDA_LAUNCH_BLOCKING put it in the rotary+cache kernel of the engine's memory-profile
prefill, whose positions ran past the model's rotary table (fixed in the engine's
``profile_batch``); which allocations surround that table, and so whether the read faulted,
depended on what ran before. With the fix the suite passed with it on (34 passed).

NOTE (benchmarks/decode_ab.sh, one H100, triton 3.6, torch 2.11, 2026-11-24,
results/s12-h100/h17a-call1, two alternating rounds, engine_bench decode, ms a step): Llama-3-8B
batch 1 5.826 / 5.822 with it against 5.832 / 5.829 with torch's, batch 8 6.272 / 6.296 against
6.336 / 6.330. Session 13 (results/s13-h100/call2, same script): batch 1 5.588 / 5.591 with it
against 5.612 / 5.609.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.common import is_interpreted, num_sms, zeroed_counters
from atom_kernels.registry import register_op

ENABLED = envs.ATOM_TRITON_ARGMAX
BIG = tl.constexpr(2147483647)  # "no index" (int32 max)


@triton.jit(do_not_specialize=["chunk", "num_splits"])
def _argmax_kernel(
    logits_ptr,
    out_ptr,
    part_v_ptr,  # [B, S] fp32: each chunk's largest value (NaNs left out)
    part_i_ptr,  # [B, S, 2] int32: its lowest index, and the chunk's first NaN (BIG: none)
    count_ptr,  # [B] int32 counters, zero between calls
    vocab_size,
    chunk,
    num_splits,
    stride_lb,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # grid (B, S): program (row, split) walks columns [split * chunk, (split + 1) * chunk)
    row = tl.program_id(0)
    split = tl.program_id(1)
    if USE_PDL:  # the logits are the previous kernel's output
        pdl.wait_for_previous()
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab_size)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    best = tl.full([], neg_inf, tl.float32)
    best_i = tl.full([], BIG, tl.int32)
    nan_i = tl.full([], BIG, tl.int32)
    for start in range(lo, hi, BLOCK_V):
        cols = start + offs
        mask = cols < hi
        x = tl.load(row_ptr + cols, mask=mask, other=neg_inf).to(tl.float32)
        is_nan = x != x
        nan_i = tl.minimum(nan_i, tl.min(tl.where(is_nan & mask, cols, BIG), axis=0))
        x = tl.where(is_nan, neg_inf, x)
        block_max = tl.max(x, axis=0)
        block_i = tl.min(tl.where((x == block_max) & mask, cols, BIG), axis=0)
        # Chunks are walked in order: a later block wins only with a larger value.
        better = (block_max > best) | ((block_max == best) & (block_i < best_i))
        best = tl.where(better, block_max, best)
        best_i = tl.where(better, block_i, best_i)
    part = row.to(tl.int64) * num_splits + split
    tl.store(part_v_ptr + part, best)
    tl.store(part_i_ptr + part * 2, best_i)
    tl.store(part_i_ptr + part * 2 + 1, nan_i)
    tl.debug_barrier()  # the partials stored before the release below
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if arrived == num_splits - 1:  # the row's last program: merge its partials
        splits = tl.arange(0, BLOCK_S)
        valid = splits < num_splits
        parts = row.to(tl.int64) * num_splits + splits
        values = tl.load(part_v_ptr + parts, mask=valid, other=neg_inf, cache_modifier=".cg")
        indices = tl.load(part_i_ptr + parts * 2, mask=valid, other=BIG, cache_modifier=".cg")
        nans = tl.load(part_i_ptr + parts * 2 + 1, mask=valid, other=BIG, cache_modifier=".cg")
        top = tl.max(values, axis=0)
        token = tl.min(tl.where(values == top, indices, BIG), axis=0)
        first_nan = tl.min(nans, axis=0)
        token = tl.where(first_nan < BIG, first_nan, token)
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0)  # ready for the next call


def _splits(num_rows: int, vocab_size: int, block_v: int, sms: int) -> tuple[int, int]:
    """(num_splits, chunk): about two programs per SM over all rows, whole blocks per chunk."""
    splits = max(1, min(triton.cdiv(vocab_size, block_v), triton.cdiv(2 * sms, num_rows)))
    chunk = triton.cdiv(triton.cdiv(vocab_size, splits), block_v) * block_v
    return triton.cdiv(vocab_size, chunk), chunk


def greedy_argmax(
    logits: torch.Tensor,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """logits [B, V] -> int64 [B] (into ``out``, contiguous, when given), torch.argmax(logits,
    -1) exactly. ``block_v`` and ``num_splits`` override the tiling (tests)."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=device)
    elif out.shape != (num_rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(
            f"greedy_argmax: out must be a contiguous int64 tensor of shape ({num_rows},) for "
            f"logits of {num_rows} rows; got {out.dtype} {tuple(out.shape)}"
        )
    if num_rows == 0:
        return out
    counters = zeroed_counters(device, num_rows)
    if counters is None:  # inside a graph capture with too few counters: torch's
        return torch.argmax(logits, dim=-1, out=out)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if block_v is None:
        # 1024 columns a block, more for vocabularies over 1M (at most 1024 partials a row)
        block_v = 64 if is_interpreted(device) else 1024
        block_v = max(block_v, triton.next_power_of_2(triton.cdiv(vocab_size, 1024)))
    if num_splits is None:
        num_splits, chunk = _splits(num_rows, vocab_size, block_v, num_sms(device))
    else:
        chunk = triton.cdiv(triton.cdiv(vocab_size, num_splits), block_v) * block_v
        num_splits = triton.cdiv(vocab_size, chunk)
    part_v = torch.empty((num_rows, num_splits), dtype=torch.float32, device=device)
    part_i = torch.empty((num_rows, num_splits, 2), dtype=torch.int32, device=device)
    use_pdl = pdl.enabled(device)
    _argmax_kernel[(num_rows, num_splits)](
        logits,
        out,
        part_v,
        part_i,
        counters,
        vocab_size,
        chunk,
        num_splits,
        logits.stride(0),
        BLOCK_V=block_v,
        # One merge width for every split count of this vocabulary: one compiled variant.
        BLOCK_S=triton.next_power_of_2(triton.cdiv(vocab_size, block_v)),
        USE_PDL=use_pdl,
        num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


@register_op("greedy_argmax", "triton")
def greedy_argmax_op(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel (16- and 32-bit logits; ``ATOM_TRITON_ARGMAX=0``: torch's argmax)."""
    if not ENABLED or logits.dtype == torch.float64:
        return logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)
    return greedy_argmax(logits, out)
