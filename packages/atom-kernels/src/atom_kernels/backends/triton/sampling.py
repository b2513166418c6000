"""Triton sampling: temperature draws in one pass over the logits (Gumbel-max), other cases torch.

``_sample_kernel`` gives each row one program that walks the vocabulary once, in the logits'
dtype, and keeps four running values: the greedy argmax, the log-sum-exp of the raw logits (for
the chosen token's log-prob), and the argmax of ``logits / T + G`` with G ~ Gumbel(0, 1) i.i.d. (a
draw from softmax(logits / T), the same distribution as the torch reference's exponential race).
The noise is Philox (``tl.rand``) keyed by a seed drawn from torch's global generator on the
device, so ``torch.manual_seed`` makes draws reproducible and nothing syncs the host.

``sampling_block.py`` draws the same distribution with one Philox draw per block of tokens (and
per token of the one block drawn): the default; ``ATOM_SAMPLE_KERNEL=gumbel`` (or
``fused_sample(..., kernel="gumbel")``) takes this file's kernel. Both write the same split
partials, merged by ``_sample_reduce_kernel``.

NOTE (benchmarks/sample_ab.py, one H100, triton 3.6, torch 2.11, 2026-11-24, results/s13-h100/
samp-call1, Qwen3's 151,936 tokens, T = 1.0, CUDA graph, cold L2, us a call, per-token / block):
bf16 batch 1 25.3 / 15.5, 8 26.3 / 16.4, 64 93.4 / 37.5, 128 173.3 / 60.8, 256 325.0 / 103.7
(fp32 alike: 319.5 / 105.7 at 256; T = 0.6 ~15% more for the block kernel, its second exp);
reading the bf16 logits once (torch.amax) 9.1 / 10.3 / 21.8 / 33.0 / 51.3. Those block times are
with 8 warps and 2 programs an SM at every batch; the tiling now used at 64+ rows measured
30.9 / 46.0 / 76.5 (bf16 64 / 128 / 256) in the same run's sweep.

The torch reference takes the rest: top-k / top-p / min-p filters, per-request generators (their
streams are torch's), and top log-probs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.torch import sampling as reference
from atom_kernels.backends.triton import sampling_block
from atom_kernels.backends.triton.common import is_interpreted, num_sms

_SAMPLING_EPS = reference._SAMPLING_EPS
# The draw's kernel, and the Philox keys each takes: "gumbel" (noise per token, one pass) or
# "block" (noise per block of tokens, then per token inside the drawn block; sampling_block.py).
KERNELS = {"gumbel": ("token",), "block": ("block", "token")}
KERNEL = envs.ATOM_SAMPLE_KERNEL


@triton.jit
def _better(value, index, best_value, best_index):
    """(value, index) beats (best_value, best_index): larger, ties to the lower index."""
    return (value > best_value) | ((value == best_value) & (index < best_index))


@triton.jit
def _argmax_merge(best_value, best_index, values, indices):
    """Fold a block's max (lowest index among equal values) into the running best."""
    block_max = tl.max(values, axis=0)
    block_index = tl.min(tl.where(values == block_max, indices, 2147483647), axis=0)
    better = _better(block_max, block_index, best_value, best_index)
    return tl.where(better, block_max, best_value), tl.where(better, block_index, best_index)


# NOTE: the split count and chunk follow the batch size; not specialized on (a variant compiled in
# the middle of a run otherwise: seen in the H100 throughput benchmark).
@triton.jit(do_not_specialize=["chunk", "num_splits"])
def _sample_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    token_ids_ptr,
    logprobs_ptr,
    part_f_ptr,  # [B, S, 4] fp32 partials: max, sum (of exp(x - max)), best raw, best draw
    part_i_ptr,  # [B, S, 2] int32 partials: ids of the best raw and the best draw
    vocab_size,
    chunk,
    num_splits,
    stride_lb,
    SINGLE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # grid (B, S): program (row, split) walks columns [split * chunk, (split + 1) * chunk)
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab_size)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    greedy = temperature < 1e-5  # vLLM's epsilon, as the reference
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr)
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    run_max = tl.full([], neg_inf, tl.float32)  # of the raw logits (log-sum-exp)
    run_sum = tl.zeros([], tl.float32)
    best_raw, best_raw_i = tl.full([], neg_inf, tl.float32), tl.zeros([], tl.int32)
    best_draw, best_draw_i = tl.full([], neg_inf, tl.float32), tl.zeros([], tl.int32)
    for start in range(lo, hi, BLOCK_V):
        cols = start + offs
        mask = cols < hi
        x = tl.load(row_ptr + cols, mask=mask, other=neg_inf).to(tl.float32)
        run_max, run_sum = _lse_step(run_max, run_sum, x)
        best_raw, best_raw_i = _argmax_merge(best_raw, best_raw_i, x, cols)
        if temperature >= 1e-5:  # Gumbel(0, 1) noise keyed by the global column: split-invariant
            u = tl.rand(seed, row.to(tl.int64) * vocab_size + cols)
            u = tl.maximum(u, 1e-20)  # tl.rand is in [0, 1): log(0) would make an infinite draw
            draw = tl.where(x > neg_inf, x * inv_t - tl.log(-tl.log(u)), neg_inf)
            best_draw, best_draw_i = _argmax_merge(best_draw, best_draw_i, draw, cols)
    if SINGLE:
        _finish(row_ptr, row, greedy, run_max, run_sum, best_raw_i, best_draw_i, token_ids_ptr,
                logprobs_ptr)  # fmt: skip
    else:
        part = row.to(tl.int64) * num_splits + split
        tl.store(part_f_ptr + part * 4 + 0, run_max)
        tl.store(part_f_ptr + part * 4 + 1, run_sum)
        tl.store(part_f_ptr + part * 4 + 2, best_raw)
        tl.store(part_f_ptr + part * 4 + 3, best_draw)
        tl.store(part_i_ptr + part * 2 + 0, best_raw_i)
        tl.store(part_i_ptr + part * 2 + 1, best_draw_i)


@triton.jit
def _lse_step(run_max, run_sum, x):
    """Fold a block into a running (max, sum of exp(x - max)); -inf entries add nothing."""
    neg_inf = float("-inf")
    new_max = tl.maximum(run_max, tl.max(x, axis=0))
    # exp2 of -inf - -inf is NaN: a row (so far) of -inf adds nothing.
    scale = tl.where(new_max == neg_inf, 0.0, tl.exp2((run_max - new_max) * 1.4426950408889634))
    shifted = tl.where(x > neg_inf, (x - new_max) * 1.4426950408889634, neg_inf)
    return new_max, run_sum * scale + tl.sum(tl.exp2(shifted), axis=0)


@triton.jit
def _finish(row_ptr, row, greedy, run_max, run_sum, best_raw_i, best_draw_i, token_ids_ptr,
            logprobs_ptr):  # fmt: skip
    token = tl.where(greedy, best_raw_i, best_draw_i)
    chosen = tl.load(row_ptr + token).to(tl.float32)
    tl.store(token_ids_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - run_max - tl.log(run_sum))


@triton.jit(do_not_specialize=["num_splits"])
def _sample_reduce_kernel(
    logits_ptr,
    temperature_ptr,
    token_ids_ptr,
    logprobs_ptr,
    part_f_ptr,
    part_i_ptr,
    num_splits,
    stride_lb,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_S)
    valid = splits < num_splits
    part = row.to(tl.int64) * num_splits + splits
    neg_inf = float("-inf")
    maxes = tl.load(part_f_ptr + part * 4 + 0, mask=valid, other=neg_inf)
    sums = tl.load(part_f_ptr + part * 4 + 1, mask=valid, other=0.0)
    run_max = tl.max(maxes, axis=0)
    weights = tl.where(maxes > neg_inf, tl.exp2((maxes - run_max) * 1.4426950408889634), 0.0)
    run_sum = tl.sum(sums * weights, axis=0)
    big = 2147483647
    raw = tl.load(part_f_ptr + part * 4 + 2, mask=valid, other=neg_inf)
    raw_i = tl.load(part_i_ptr + part * 2 + 0, mask=valid, other=big)
    draw = tl.load(part_f_ptr + part * 4 + 3, mask=valid, other=neg_inf)
    draw_i = tl.load(part_i_ptr + part * 2 + 1, mask=valid, other=big)
    best_raw_i = tl.min(tl.where(raw == tl.max(raw, axis=0), raw_i, big), axis=0)
    best_draw_i = tl.min(tl.where(draw == tl.max(draw, axis=0), draw_i, big), axis=0)
    greedy = tl.load(temperature_ptr + row).to(tl.float32) < 1e-5
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
    _finish(row_ptr, row, greedy, run_max, run_sum, best_raw_i, best_draw_i, token_ids_ptr,
            logprobs_ptr)  # fmt: skip


def choose_splits(num_seqs: int, vocab_size: int, block_v: int, sms: int, min_chunk: int,
                  programs_per_sm: int = 2):  # fmt: skip
    """(num_splits, chunk): a row's vocabulary over several programs when the rows alone leave
    SMs idle (about ``programs_per_sm`` programs per SM), chunks of at least ``min_chunk``
    columns (a multiple of ``block_v``)."""
    splits = max(1, min(programs_per_sm * sms // max(num_seqs, 1), vocab_size // min_chunk))
    chunk = triton.cdiv(triton.cdiv(vocab_size, splits), block_v) * block_v
    return triton.cdiv(vocab_size, chunk), chunk


def fused_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    num_splits: int | None = None,
    kernel: str | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [B] int64, their log-probs [B] fp32): greedy or temperature draws, every row.
    ``kernel`` is "gumbel" (noise per token) or "block" (noise per block of tokens,
    ``sampling_block.py``), ``KERNEL`` when None; ``num_splits``, ``block_v`` and ``num_warps``
    override the tiling (tests, benchmarks)."""
    kernel = KERNEL if kernel is None else kernel
    if kernel not in KERNELS:
        raise ValueError(f"fused_sample: kernel must be one of {KERNELS}, got {kernel!r}")
    num_seqs, vocab_size = logits.shape
    device = logits.device
    token_ids = torch.empty(num_seqs, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_seqs, dtype=torch.float32, device=device)
    if num_seqs == 0:
        return token_ids, logprobs
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    temperature = temperature.contiguous()
    # Fresh Philox keys per call from torch's generator: on the device, no host sync.
    seeds = torch.randint(0, 2**31 - 1, (len(KERNELS[kernel]),), dtype=torch.int32, device=device)
    interpreted = is_interpreted(device)
    if block_v is None:
        block_v = 64 if interpreted else 2048
    block_v = min(block_v, triton.next_power_of_2(vocab_size))
    sms, min_chunk = num_sms(device), block_v if interpreted else max(8192, block_v)
    # One merge width for every split count of this vocabulary: one compiled variant.
    most_splits = choose_splits(1, vocab_size, block_v, sms, min_chunk)[0]
    # NOTE (H100, 2026-11-24, results/s13-h100/samp-call1 sample_ab.json, cold L2, us): the block
    # kernel at 64-256 rows is fastest with 4 warps (16 logits a thread) and ~4 programs an SM:
    # bf16 batch 64 / 128 / 256 30.9 / 46.0 / 76.5 against 35.5 / 59.7 / 101.2 with 8 warps and
    # 2 programs an SM (fp32 35.4 / 51.2 / 82.2). Fewer rows keep 8 warps, 2 an SM (measured).
    wide = kernel == "block" and num_seqs >= 64 and not interpreted
    if num_splits is None:
        num_splits, chunk = choose_splits(
            num_seqs, vocab_size, block_v, sms, min_chunk, programs_per_sm=4 if wide else 2
        )
    else:
        chunk = triton.cdiv(triton.cdiv(vocab_size, num_splits), block_v) * block_v
        num_splits = triton.cdiv(vocab_size, chunk)
    if num_warps is None:
        num_warps = 8 if block_v >= 2048 and not wide else 4
    part_f = torch.empty((num_seqs, num_splits, 4), dtype=torch.float32, device=device)
    part_i = torch.empty((num_seqs, num_splits, 2), dtype=torch.int32, device=device)
    if kernel == "block":
        sampling_block.launch(
            logits, temperature, seeds, token_ids, logprobs, part_f, part_i, chunk, num_splits,
            block_v, num_warps,
        )  # fmt: skip
    else:
        _sample_kernel[(num_seqs, num_splits)](
            logits, temperature, seeds, token_ids, logprobs, part_f, part_i, vocab_size, chunk,
            num_splits, logits.stride(0), SINGLE=num_splits == 1, BLOCK_V=block_v,
            num_warps=num_warps,
        )  # fmt: skip
    if num_splits > 1:
        _sample_reduce_kernel[(num_seqs,)](
            logits, temperature, token_ids, logprobs, part_f, part_i, num_splits,
            logits.stride(0), BLOCK_S=triton.next_power_of_2(max(num_splits, most_splits)),
            num_warps=1,
        )  # fmt: skip
    return token_ids, logprobs


def takes(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    generators: list[torch.Generator | None] | None,
    num_logprobs: int,
) -> bool:
    """Whether the fused kernel draws this batch: no row filters, seeds or asks for top logprobs
    (the torch reference does the rest)."""
    return (
        top_k is None
        and top_p is None
        and min_p is None
        and num_logprobs == 0
        and (generators is None or all(g is None for g in generators))
        and logits.dtype != torch.float64
    )
