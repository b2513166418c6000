"""Triton filtered sampling: top-k, top-p and min-p thresholds found by a search over the logits'
ordered bit patterns, then the Gumbel-max draw, in one kernel with no host sync.

One program per row. Each filter keeps ``x >= t`` for a per-row ``t`` (``sampling_threshold``
explains why, and is this kernel's reference): a float's bits, with the negative ones' magnitude
bits flipped, order as int32 the way the floats do (``_key``), so ``t`` is found over the int32
range, ``WAYS`` candidate keys a pass over the row:

- top-k: the largest key with at least k logits at or above it, which is the k-th largest logit
  (ties with it kept, as the reference keeps them): read off the row's TOP largest logits, kept
  by the first pass, when k <= TOP; else about 32 / log2(WAYS) passes;
- top-p (over the top-k set, tempered): the largest key whose tempered mass at or above it
  reaches p times the top-k set's, one pass for that mass, then read off the TOP largest when
  the cut lies above the TOP-th (every logit at or above it is among them), else as many passes
  again as top-k's search;
- min-p: ``x / T >= max / T + log(min_p)``, closed form.

The temperature never reorders the logits, so the keys are the raw logits' and only the masses
are tempered. Then one pass draws ``argmax(x / T + G)`` over the kept logits (G ~ Gumbel(0, 1),
Philox keyed by a seed from torch's generator, as ``sampling._sample_kernel``); a greedy row
(T < 1e-5) takes the raw argmax, and every row gets the raw log-prob of its token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton.common import is_interpreted
from atom_kernels.backends.triton.sampling import _argmax_merge, _finish, _lse_step

WAYS = 4  # candidate keys a pass: ~16 passes per 32-bit search (measured below)
# The largest logits the first pass keeps for a row with a top-k of at most TOP (``tl.topk`` of
# each block merged into a running top): its top-k, and a top-p cut above the TOP-th largest
# logit, are read off them with no search. Fewer under the interpreter, so that the tests take
# both paths. Rows without such a top-k (top-p alone, min-p) search as before: keeping the top
# costs about a search's passes (measured below).
# ATOM_SAMPLE_TOP (read at import): TOP for an A/B in the engine, 0: every threshold searched.
TOP = envs.ATOM_SAMPLE_TOP
if TOP < 0 or TOP & (TOP - 1):  # tl.topk / tl.sort take powers of two
    raise ValueError(f"ATOM_SAMPLE_TOP={TOP}: expected 0 or a power of two (64 by default)")
TOP_INTERPRETED = 16 if TOP else 0
# Work a block cannot change, skipped: the top merge of a block whose largest logit is not above
# the kept TOP-th, and the noise and draw of a block with no kept logit (both exact: the same
# top, the same draws); top-p's mass pass when the top-k set lies in the kept top, its mass then
# summed over the top (the same terms in another order: fp32 rounding apart, so a cut that falls
# within a rounding of p can land one logit over). ATOM_SAMPLE_PRUNE=0: off (read at import,
# A/B).
# NOTE (benchmarks/sample_filter_ab.py --prunes 1 0, one H200, triton 3.6, 2026-12-02,
# results/sampling/s27/sample-prune-ab.json; ms a call, vocab 128,256, pruned / not, flat and
# peaked logits): top-k 50 + top-p 0.9, batch 1: 0.49 / 0.60, 0.45 / 0.60; 64: 0.51 / 0.60,
# 0.47 / 0.59; 256: 0.74 / 0.94, 0.73 / 0.96; min-p 0.1 at 256: 0.21 / 0.31, 0.19 / 0.31
# (1.2-1.65x); top-p 0.95 alone 1.00-1.10x. FlashInfer's top_k_top_p_sampling_from_logits
# against the op at 256 rows, the same day: 0.506 against 0.751 ms (1.48x; 1.9x before).
PRUNE = envs.ATOM_SAMPLE_PRUNE


@triton.jit
def _key(x):
    """Ordered int64 key of fp32 ``x``: the int32 bits, negatives' magnitude bits flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _value(key):
    """The fp32 whose ``_key`` is ``key`` (the flip is its own inverse)."""
    bits = key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _search(row_ptr, vocab_size, lo, hi, need, m, inv_t, MASS: tl.constexpr,
            BLOCK_V: tl.constexpr, WAYS_: tl.constexpr):  # fmt: skip
    """The largest key in [lo, hi] whose count (MASS: tempered mass exp((x - m) / T)) of logits
    at or above its value reaches ``need``; ``lo`` must reach it. The pivots are searched as keys
    and compared as floats (one fp32 compare a logit a pivot)."""
    offs = tl.arange(0, BLOCK_V)
    ways = tl.arange(0, WAYS_)
    while lo < hi:
        step = (hi - lo + WAYS_) // WAYS_
        pivots = lo + (ways + 1).to(tl.int64) * step  # [WAYS]
        live = pivots <= hi
        values = _value(tl.where(live, pivots, hi))
        total = tl.zeros([WAYS_], tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + offs
            valid = cols < vocab_size
            x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
            above = x[None, :] >= values[:, None]
            if MASS:
                weight = tl.where(valid, tl.exp2((x - m) * inv_t * 1.4426950408889634), 0.0)
                total += tl.sum(tl.where(above, weight[None, :], 0.0), axis=1)
            else:
                total += tl.sum((above & valid[None, :]).to(tl.float32), axis=1)
        # Counts and masses fall as the pivot rises: the pivots that reach ``need`` are a prefix.
        reached = tl.sum((live & (total >= need)).to(tl.int64), axis=0)
        new_lo = lo + reached * step
        hi = tl.minimum(hi, lo + (reached + 1) * step - 1)
        lo = new_lo
    return lo


@triton.jit
def _filtered_sample_kernel(
    logits_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    token_ids_ptr,
    logprobs_ptr,
    thresholds_ptr,  # [B] int64: each row's threshold key (kept: x >= _value(it))
    vocab_size,
    stride_lb,
    HAS_K: tl.constexpr,
    HAS_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK_V: tl.constexpr,
    WAYS_: tl.constexpr,
    TOP: tl.constexpr,
    USE_TOP: tl.constexpr,
    PRUNE: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    greedy = temperature < 1e-5  # vLLM's epsilon, as the reference
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    # Pass 1: the raw max (and argmax), the log-sum-exp, the smallest key.
    run_max = tl.full([], neg_inf, tl.float32)
    run_sum = tl.zeros([], tl.float32)
    best_raw, best_raw_i = tl.full([], neg_inf, tl.float32), tl.zeros([], tl.int32)
    low = tl.full([], float("inf"), tl.float32)
    k = tl.zeros([], tl.int64)
    if HAS_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
    # A row with a top-k of at most TOP keeps its TOP largest logits (``top``) in this pass.
    keep_top = (k > 0) & (k <= TOP) & (k < vocab_size)  # only read where USE_TOP and HAS_K
    top = tl.full([TOP], neg_inf, tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offs
        valid = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=valid, other=neg_inf).to(tl.float32)
        run_max, run_sum = _lse_step(run_max, run_sum, x)
        best_raw, best_raw_i = _argmax_merge(best_raw, best_raw_i, x, cols)
        low = tl.minimum(low, tl.min(tl.where(valid, x, float("inf")), axis=0))
        if USE_TOP and HAS_K:
            merge = keep_top
            if PRUNE:  # a block whose largest is not above the kept TOP-th changes nothing
                merge = merge & (tl.max(x, axis=0) > tl.min(top, axis=0))
            if merge:
                top = tl.topk(tl.cat(top, tl.topk(x, TOP), can_reorder=True), TOP)
    low_key = _key(low)
    high_key = _key(run_max)
    threshold = low_key
    if USE_TOP:  # (a sort of one value does not compile: TOP is 1 when off)
        top = tl.sort(top, descending=True)
        ranks = tl.arange(0, TOP)
        # Every logit above the TOP-th largest is in ``top`` (those equal to it may not be).
        bottom = tl.min(top, axis=0)
    if HAS_K:
        if (k > 0) & (k < vocab_size):
            if USE_TOP:
                if keep_top:  # the k-th largest logit, read off the sorted top
                    threshold = _key(tl.max(tl.where(ranks == k - 1, top, neg_inf), axis=0))
                else:
                    threshold = _search(row_ptr, vocab_size, low_key, high_key, k.to(tl.float32),
                                        run_max, inv_t, False, BLOCK_V, WAYS_)  # fmt: skip
            else:
                threshold = _search(row_ptr, vocab_size, low_key, high_key, k.to(tl.float32),
                                    run_max, inv_t, False, BLOCK_V, WAYS_)  # fmt: skip
    if HAS_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:
            kept_mass = tl.zeros([], tl.float32)
            in_top = False
            if USE_TOP and HAS_K and PRUNE:
                # The top-k set above the TOP-th largest lies in ``top``: its mass from there.
                in_top = keep_top & (_value(threshold) > bottom)
            if in_top:
                scaled = (top - run_max) * inv_t * 1.4426950408889634
                kept_mass = tl.sum(tl.where(top >= _value(threshold), tl.exp2(scaled), 0.0), 0)
            else:
                for start in range(0, vocab_size, BLOCK_V):
                    cols = start + offs
                    valid = cols < vocab_size
                    x = tl.load(row_ptr + cols, mask=valid, other=neg_inf).to(tl.float32)
                    keep = valid & (x >= _value(threshold))
                    scaled = (x - run_max) * inv_t * 1.4426950408889634
                    kept_mass += tl.sum(tl.where(keep, tl.exp2(scaled), 0.0), axis=0)
            need = p * kept_mass
            found = False
            if USE_TOP and HAS_K:
                # The largest kept logit v above ``bottom`` whose mass at or above v reaches
                # ``need`` (every logit >= v is in ``top``): the search's answer, when it is one.
                cut = _value(threshold)
                weight = tl.where(top >= cut, tl.exp2((top - run_max) * inv_t * 1.4426950408889634),
                                  0.0)  # fmt: skip
                above = tl.sum(tl.where(top[None, :] >= top[:, None], weight[None, :], 0.0), axis=1)
                fits = keep_top & (top > bottom) & (top >= cut) & (above >= need)
                best = tl.max(tl.where(fits, top, neg_inf), axis=0)
                found = best > neg_inf
                if found:
                    threshold = _key(best)
            if not found:
                threshold = _search(row_ptr, vocab_size, threshold, high_key, need,
                                    run_max, inv_t, True, BLOCK_V, WAYS_)  # fmt: skip
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        if min_p > 0.0:
            # x / T >= max / T + log(min_p)  <=>  x >= max + T log(min_p)
            floor = run_max + tl.log(min_p) / inv_t
            threshold = tl.maximum(threshold, _key(floor))
    tl.store(thresholds_ptr + row, threshold)
    cut = _value(threshold)
    best_draw, best_draw_i = tl.full([], neg_inf, tl.float32), tl.zeros([], tl.int32)
    if temperature >= 1e-5:
        seed = tl.load(seed_ptr)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + offs
            valid = cols < vocab_size
            x = tl.load(row_ptr + cols, mask=valid, other=neg_inf).to(tl.float32)
            draws = True
            if PRUNE:  # a block with nothing kept draws nothing (no noise drawn for it)
                draws = tl.max(x, axis=0) >= cut
            if draws:
                u = tl.rand(seed, row.to(tl.int64) * vocab_size + cols)
                u = tl.maximum(u, 1e-20)  # tl.rand is in [0, 1): log(0): an infinite draw
                keep = valid & (x >= cut) & (x > neg_inf)
                draw = tl.where(keep, x * inv_t - tl.log(-tl.log(u)), neg_inf)
                best_draw, best_draw_i = _argmax_merge(best_draw, best_draw_i, draw, cols)
    _finish(row_ptr, row, greedy, run_max, run_sum, best_raw_i, best_draw_i, token_ids_ptr,
            logprobs_ptr)  # fmt: skip


# NOTE (benchmarks/sample_filter_ab.py, one H200, triton 3.6, torch 2.11, 2026-11-28,
# results/sampling/s21/sample_filter_ab_ways.json; ms a call, vocab 128,256, fp32 logits, the
# reference's sort / this kernel with 4 / 8 / 16 pivots a pass):
#   top-k 50 + top-p 0.9, batch 1: 0.98 / 1.62 / 2.36 / 4.73; 64: 2.10 / 1.68 / 2.40 / 4.77;
#   256: 6.71 / 2.69 / 3.81 / 6.95
#   top-p 0.95, batch 1: 0.74 / 0.99; 64: 1.51 / 1.00; 256: 4.48 / 1.65
#   min-p 0.1, batch 1: 0.42 / 0.19; 64: 0.50 / 0.20; 256: 1.17 / 0.30
# (151,936 alike, ~18% more.) One program walks a row ~35 times at ~45 us a walk: latency, not
# bandwidth, bounds it, so small batches take ``sampling_filter_split`` (a row over programs,
# a launch a search step; its NOTE has the numbers); from ``SPLIT_BELOW`` rows, this kernel.
# NOTE (the same script with --tops 0 64, one H200, 2026-12-01, results/sampling/s26/
# sample-filter-top-final.json; ms a call at vocab 128,256, searched / the top read off / the
# split kernel): top-k 50 + top-p 0.9, batch 1: 1.63 / 0.61 / 0.98; 8: 1.67 / 0.61 / 0.98; 64:
# 1.68 / 0.61 / 1.82; 256: 2.71 / 0.96 / 7.09 (2.7-2.8x at every batch; 151,936 alike in the
# first call, sample-filter-top.json); top-p 0.95 and min-p 0.1 alone unchanged (1.00-1.04x).
# The first call also kept the top for top-p-only rows: 0.64x when the nucleus is wide (4 N(0, 1)
# logits, p 0.95: 1.66 -> 2.52 ms at 256 rows), so such rows search as before. At 64 rows this
# kernel is ahead of the split one for all three filters (0.61 / 1.01 / 0.20 ms against 1.82 /
# 1.10 / 0.27; the first call had min-p 0.19 against 0.15); below 32 the split one wins top-p
# alone (0.40-0.80 against 1.00 ms): SPLIT_BELOW 64 (128 before).
SPLIT_BELOW = envs.ATOM_SAMPLE_SPLIT_BELOW  # 64 unless set (ATOM_SAMPLE_SPLIT_BELOW: A/B)


def filtered_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    block_v: int | None = None,
    num_warps: int | None = None,
    thresholds: torch.Tensor | None = None,
    ways: int = WAYS,
    top: int | None = None,
    prune: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [B] int64, their raw log-probs [B] fp32): each row drawn from its tempered
    logits after top-k, then top-p, then min-p (any of the three None: off for every row).
    ``thresholds`` ([B] int64, tests): gets each row's threshold as a key (``values`` turns it
    into the logit: each row keeps ``x >= value``); ``ways``: pivots a pass (benchmarks); ``top``:
    the largest logits the first pass keeps (a power of two, at most the block; 0: none, every
    threshold searched; default TOP, TOP_INTERPRETED under the interpreter); ``prune``: skip the
    work a block cannot change (default PRUNE; off: the kernel before session 27)."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    token_ids = torch.empty(num_seqs, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_seqs, dtype=torch.float32, device=device)
    if num_seqs == 0:
        return token_ids, logprobs
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=device)
    interpreted = is_interpreted(device)
    if block_v is None:
        block_v = 64 if interpreted else 8192 // ways
    block_v = min(block_v, triton.next_power_of_2(vocab_size))
    if top is None:
        top = TOP_INTERPRETED if interpreted else TOP
    top = min(top, block_v)
    dummy = temperature
    if thresholds is None:
        thresholds = torch.empty(num_seqs, dtype=torch.int64, device=device)
    _filtered_sample_kernel[(num_seqs,)](
        logits, temperature.contiguous(),
        dummy if top_k is None else top_k.contiguous(),
        dummy if top_p is None else top_p.contiguous(),
        dummy if min_p is None else min_p.contiguous(),
        seed, token_ids, logprobs, thresholds, vocab_size, logits.stride(0),
        HAS_K=top_k is not None, HAS_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK_V=block_v, WAYS_=ways, TOP=max(top, 1), USE_TOP=top > 0,
        PRUNE=PRUNE if prune is None else prune, num_warps=num_warps or 8,
    )  # fmt: skip
    return token_ids, logprobs


def values(keys: torch.Tensor) -> torch.Tensor:
    """``_value`` in torch: the fp32 logits of int64 ``keys``."""
    bits = keys.to(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).view(torch.float32)
