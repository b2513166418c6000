"""Triton filtered sampling with each row split over programs: ``sampling_filter``'s search (the
same thresholds, the same draw), one launch per search step.

``sampling_filter`` walks a row with one program ~35 times; on one H200 a walk of 128K logits
takes ~45 us, latency-bound, so small batches lose to the sort. Here a grid of (row, split)
programs walks a row's chunks in parallel, and each search step is a launch: every program reads
the row's state (the key interval [lo, hi] and, for top-p, the top-k set's mass) and the per-split
totals of the previous launch's pivots, applies the same update as every other program of the row
(so no program waits for another), counts or weighs its chunk against the new pivots, and writes
its totals; split 0 also writes the new state. State and totals alternate between two buffers by
the launch's parity, so a launch never reads what it writes. Launches: the statistics (max, sum,
argmax, min per chunk), ``STEPS`` for top-k, ``STEPS`` for top-p (the first also weighs the top-k
set), the draw, and ``sampling._sample_reduce_kernel``'s merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import is_interpreted, num_sms
from atom_kernels.backends.triton.sampling import (
    _argmax_merge,
    _lse_step,
    _sample_reduce_kernel,
    choose_splits,
)
from atom_kernels.backends.triton.sampling_filter import _key, _value

WAYS = 8  # pivots a step: 11 steps narrow 2^32 keys to one
STEPS = {8: 12, 16: 10}  # launches per search by WAYS (the updates needed, one to spare)

# NOTE (benchmarks/sample_filter_ab.py, one H200, triton 3.6, torch 2.11, 2026-11-28,
# results/sampling/s21/sample_filter_ab_split.json; ms a call, vocab 128,256, fp32, the reference's
# sort / ``sampling_filter`` (one program a row, 4 pivots) / this with 8 / 16 pivots a step):
#   top-k 50 + top-p 0.9, batch 1: 0.70 / 1.62 / 0.63 / 0.59; 8: 0.86 / 1.62 / 0.60 / 0.58;
#   64: 2.07 / 1.64 / 1.00 / 1.80; 256: 6.63 / 2.69 / 4.20 / 7.32
#   top-p 0.95, batch 1: 0.46 / 0.98 / 0.40 / 0.38; 64: 1.50 / 1.00 / 0.59 / 1.13
#   min-p 0.1, batch 1: 0.31 / 0.19 / 0.18 / 0.17; 64: 0.50 / 0.20 / 0.17 / 0.15
# At batch 1-8 the ~22 launches (Triton's Python launch, tens of us each) are most of the time;
# FlashInfer's one-kernel sampler took 0.11 ms at batch 1 (issue 42's table). From 256 rows the
# row already fills the SMs and the one-program kernel's fewer passes win (the switch is at 128,
# between the measured 64 and 256).


@triton.jit
def _stats_kernel(logits_ptr, part_f_ptr, part_i_ptr, low_ptr, vocab_size, chunk, num_splits,
                  stride_lb, BLOCK_V: tl.constexpr):  # fmt: skip
    """Per (row, split): max, sum of exp(x - max), the raw argmax, the smallest logit."""
    row, split = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    run_max, run_sum = tl.full([], neg_inf, tl.float32), tl.zeros([], tl.float32)
    best, best_i = tl.full([], neg_inf, tl.float32), tl.zeros([], tl.int32)
    low = tl.full([], float("inf"), tl.float32)
    end = tl.minimum(split * chunk + chunk, vocab_size)
    for start in range(split * chunk, end, BLOCK_V):
        cols = start + offs
        valid = cols < end
        x = tl.load(row_ptr + cols, mask=valid, other=neg_inf).to(tl.float32)
        run_max, run_sum = _lse_step(run_max, run_sum, x)
        best, best_i = _argmax_merge(best, best_i, x, cols)
        low = tl.minimum(low, tl.min(tl.where(valid, x, float("inf")), axis=0))
    part = row.to(tl.int64) * num_splits + split
    tl.store(part_f_ptr + part * 4 + 0, run_max)
    tl.store(part_f_ptr + part * 4 + 1, run_sum)
    tl.store(part_f_ptr + part * 4 + 2, best)
    tl.store(part_i_ptr + part * 2 + 0, best_i)
    tl.store(low_ptr + part, low)


@triton.jit
def _row_stats(part_f_ptr, low_ptr, row, num_splits, BLOCK_S: tl.constexpr):
    """The row's max logit and smallest logit, from the statistics' partials."""
    splits = tl.arange(0, BLOCK_S)
    valid = splits < num_splits
    part = row.to(tl.int64) * num_splits + splits
    row_max = tl.max(tl.load(part_f_ptr + part * 4 + 0, mask=valid, other=float("-inf")), axis=0)
    low = tl.min(tl.load(low_ptr + part, mask=valid, other=float("inf")), axis=0)
    return row_max, low


@triton.jit
def _update(lo, hi, need, totals_ptr, row, num_splits, BLOCK_S: tl.constexpr, WAYS_: tl.constexpr):
    """``sampling_filter._search``'s step: the new [lo, hi] from the row's per-split totals of
    the pivots of [lo, hi]."""
    ways = tl.arange(0, WAYS_)
    splits = tl.arange(0, BLOCK_S)
    base = (row.to(tl.int64) * num_splits + splits) * WAYS_
    mask = (splits < num_splits)[:, None] & (ways < WAYS_)[None, :]
    total = tl.sum(tl.load(totals_ptr + base[:, None] + ways[None, :], mask=mask, other=0.0), 0)
    step = (hi - lo + WAYS_) // WAYS_
    pivots = lo + (ways + 1).to(tl.int64) * step
    reached = tl.sum(((pivots <= hi) & (total >= need)).to(tl.int64), axis=0)
    new_hi = tl.where(lo < hi, tl.minimum(hi, lo + (reached + 1) * step - 1), hi)
    new_lo = tl.where(lo < hi, lo + reached * step, lo)
    return new_lo, new_hi


@triton.jit
def _advance(state_ptr, totals_ptr, mass_ptr, top_k_ptr, top_p_ptr, row, num_rows, it,
             num_k_steps, low, row_max, vocab_size, num_splits, HAS_K: tl.constexpr,
             BLOCK_S: tl.constexpr, WAYS_: tl.constexpr):  # fmt: skip
    """The row's [lo, hi] before launch ``it``: the initial interval at 0, else the previous
    launch's state updated with its totals (top-k counts through ``num_k_steps``, then top-p
    masses against p times the top-k set's mass)."""
    old = it % 2
    lo = tl.load(state_ptr + (old * num_rows + row) * 2 + 0)
    hi = tl.load(state_ptr + (old * num_rows + row) * 2 + 1)
    old_totals = totals_ptr + old * num_rows * num_splits * WAYS_
    if it == 0:
        lo = _key(low)
        hi = lo
        if HAS_K:
            k = tl.load(top_k_ptr + row)
            if (num_k_steps > 0) & (k > 0) & (k < vocab_size):
                hi = _key(row_max)
    elif it <= num_k_steps:
        k = tl.load(top_k_ptr + row).to(tl.float32)
        lo, hi = _update(lo, hi, k, old_totals, row, num_splits, BLOCK_S, WAYS_)
    else:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        splits = tl.arange(0, BLOCK_S)
        mass = tl.load(mass_ptr + row.to(tl.int64) * num_splits + splits,
                       mask=splits < num_splits, other=0.0)  # fmt: skip
        lo, hi = _update(lo, hi, p * tl.sum(mass, axis=0), old_totals, row, num_splits, BLOCK_S,
                         WAYS_)  # fmt: skip
    return lo, hi


@triton.jit
def _step_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, part_f_ptr, low_ptr,
                 state_ptr, totals_ptr, mass_ptr, it, num_k_steps, vocab_size, chunk,
                 num_splits, stride_lb, HAS_K: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_S: tl.constexpr, WAYS_: tl.constexpr):  # fmt: skip
    """Launch ``it`` of the searches: top-k's while it < num_k_steps, then top-p's. State:
    [2, B, 2] int64 (lo, hi) by parity; totals: [2, B, S, WAYS] fp32; mass: [B, S] fp32, the
    top-k set's tempered mass per split."""
    row, split = tl.program_id(0), tl.program_id(1)
    num_rows = tl.num_programs(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    inv_t = 1.0 / tl.where(temperature < 1e-5, 1.0, temperature)
    row_max, low = _row_stats(part_f_ptr, low_ptr, row, num_splits, BLOCK_S)
    lo, hi = _advance(state_ptr, totals_ptr, mass_ptr, top_k_ptr, top_p_ptr, row, num_rows, it,
                      num_k_steps, low, row_max, vocab_size, num_splits, HAS_K, BLOCK_S,
                      WAYS_)  # fmt: skip
    in_p = it >= num_k_steps
    first_p = it == num_k_steps
    if first_p:  # top-k found (lo == hi): top-p searches [t_k, max] when the row filters
        p = tl.load(top_p_ptr + row).to(tl.float32)
        hi = tl.where(p < 1.0, _key(row_max), lo)
    offs = tl.arange(0, BLOCK_V)
    ways = tl.arange(0, WAYS_)
    step = (hi - lo + WAYS_) // WAYS_
    pivots = lo + (ways + 1).to(tl.int64) * step
    values = _value(tl.where(pivots <= hi, pivots, hi))
    cut = _value(lo)
    total = tl.zeros([WAYS_], tl.float32)
    kept_mass = tl.zeros([], tl.float32)
    end = tl.minimum(split * chunk + chunk, vocab_size)
    if lo < hi:
        for start in range(split * chunk, end, BLOCK_V):
            cols = start + offs
            valid = cols < end
            x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
            above = x[None, :] >= values[:, None]
            if in_p:
                scaled = (x - row_max) * inv_t * 1.4426950408889634
                weight = tl.where(valid, tl.exp2(scaled), 0.0)
                total += tl.sum(tl.where(above, weight[None, :], 0.0), axis=1)
                if first_p:  # the top-k set's mass: needed once, by every later top-p step
                    kept_mass += tl.sum(tl.where(x >= cut, weight, 0.0), axis=0)
            else:
                total += tl.sum((above & valid[None, :]).to(tl.float32), axis=1)
    new = 1 - it % 2
    part = row.to(tl.int64) * num_splits + split
    tl.store(totals_ptr + new * num_rows * num_splits * WAYS_ + part * WAYS_ + ways, total)
    if first_p:
        tl.store(mass_ptr + part, kept_mass)
    if split == 0:
        tl.store(state_ptr + (new * num_rows + row) * 2 + 0, lo)
        tl.store(state_ptr + (new * num_rows + row) * 2 + 1, hi)


@triton.jit
def _draw_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,
                 part_f_ptr, part_i_ptr, low_ptr, state_ptr, totals_ptr, mass_ptr, thresholds_ptr,
                 it, num_k_steps, vocab_size, chunk, num_splits, stride_lb, HAS_K: tl.constexpr,
                 HAS_MIN_P: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
                 WAYS_: tl.constexpr):  # fmt: skip
    """The last search update, min-p, then the Gumbel-max draw over the chunk's kept logits."""
    row, split = tl.program_id(0), tl.program_id(1)
    num_rows = tl.num_programs(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    inv_t = 1.0 / tl.where(temperature < 1e-5, 1.0, temperature)
    row_max, low = _row_stats(part_f_ptr, low_ptr, row, num_splits, BLOCK_S)
    threshold, _ = _advance(state_ptr, totals_ptr, mass_ptr, top_k_ptr, top_p_ptr, row, num_rows,
                            it, num_k_steps, low, row_max, vocab_size, num_splits, HAS_K,
                            BLOCK_S, WAYS_)  # fmt: skip
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        if min_p > 0.0:  # x / T >= max / T + log(min_p)  <=>  x >= max + T log(min_p)
            threshold = tl.maximum(threshold, _key(row_max + tl.log(min_p) / inv_t))
    if split == 0:
        tl.store(thresholds_ptr + row, threshold)
    cut = _value(threshold)
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    best, best_i = tl.full([], neg_inf, tl.float32), tl.zeros([], tl.int32)
    end = tl.minimum(split * chunk + chunk, vocab_size)
    if temperature >= 1e-5:
        seed = tl.load(seed_ptr)
        for start in range(split * chunk, end, BLOCK_V):
            cols = start + offs
            valid = cols < end
            x = tl.load(row_ptr + cols, mask=valid, other=neg_inf).to(tl.float32)
            u = tl.maximum(tl.rand(seed, row.to(tl.int64) * vocab_size + cols), 1e-20)
            keep = valid & (x >= cut) & (x > neg_inf)
            draw = tl.where(keep, x * inv_t - tl.log(-tl.log(u)), neg_inf)
            best, best_i = _argmax_merge(best, best_i, draw, cols)
    part = row.to(tl.int64) * num_splits + split
    tl.store(part_f_ptr + part * 4 + 3, best)
    tl.store(part_i_ptr + part * 2 + 1, best_i)


def filtered_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    num_splits: int | None = None,
    thresholds: torch.Tensor | None = None,
    ways: int = WAYS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling_filter.filtered_sample``'s result (the same thresholds, the same draw), each row
    over ``num_splits`` programs (chosen by the batch and the SM count when None)."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    token_ids = torch.empty(num_seqs, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_seqs, dtype=torch.float32, device=device)
    if num_seqs == 0:
        return token_ids, logprobs
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    temperature = temperature.contiguous()
    interpreted = is_interpreted(device)
    block_v = min(64 if interpreted else 8192 // ways, triton.next_power_of_2(vocab_size))
    min_chunk = block_v if interpreted else max(2048, block_v)
    if num_splits is None:
        num_splits, chunk = choose_splits(num_seqs, vocab_size, block_v, num_sms(device), min_chunk)
    else:
        chunk = triton.cdiv(triton.cdiv(vocab_size, num_splits), block_v) * block_v
        num_splits = triton.cdiv(vocab_size, chunk)
    block_s = triton.next_power_of_2(num_splits)
    f32 = dict(dtype=torch.float32, device=device)
    part_f = torch.empty((num_seqs, num_splits, 4), **f32)
    part_i = torch.empty((num_seqs, num_splits, 2), dtype=torch.int32, device=device)
    low = torch.empty((num_seqs, num_splits), **f32)
    state = torch.zeros((2, num_seqs, 2), dtype=torch.int64, device=device)
    totals = torch.zeros((2, num_seqs, num_splits, ways), **f32)
    mass = torch.zeros((num_seqs, num_splits), **f32)
    if thresholds is None:
        thresholds = torch.empty(num_seqs, dtype=torch.int64, device=device)
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=device)
    dummy = temperature
    k_ptr = dummy if top_k is None else top_k.contiguous()
    p_ptr = dummy if top_p is None else top_p.contiguous()
    grid = (num_seqs, num_splits)
    warps = 4 if interpreted else 8
    stride = logits.stride(0)
    _stats_kernel[grid](logits, part_f, part_i, low, vocab_size, chunk, num_splits, stride,
                        BLOCK_V=block_v, num_warps=warps)  # fmt: skip
    steps = STEPS[ways]
    num_k_steps = steps if top_k is not None else 0
    launches = num_k_steps + (steps if top_p is not None else 0)
    for it in range(launches):
        _step_kernel[grid](
            logits, temperature, k_ptr, p_ptr, part_f, low, state, totals, mass, it, num_k_steps,
            vocab_size, chunk, num_splits, stride, HAS_K=top_k is not None, BLOCK_V=block_v,
            BLOCK_S=block_s, WAYS_=ways, num_warps=warps,
        )  # fmt: skip
    _draw_kernel[grid](
        logits, temperature, k_ptr, p_ptr, dummy if min_p is None else min_p.contiguous(), seed,
        part_f, part_i, low, state, totals, mass, thresholds, launches, num_k_steps, vocab_size,
        chunk, num_splits, stride, HAS_K=top_k is not None, HAS_MIN_P=min_p is not None,
        BLOCK_V=block_v, BLOCK_S=block_s, WAYS_=ways, num_warps=warps,
    )  # fmt: skip
    _sample_reduce_kernel[(num_seqs,)](
        logits, temperature, token_ids, logprobs, part_f, part_i, num_splits, stride,
        BLOCK_S=block_s, num_warps=1,
    )  # fmt: skip
    return token_ids, logprobs
