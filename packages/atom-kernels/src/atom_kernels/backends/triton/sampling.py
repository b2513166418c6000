"""Triton sampling: temperature draws in one pass over the logits (Gumbel-max), other cases torch.

``_sample_kernel`` gives each row one program that walks the vocabulary once, in the logits'
dtype, and keeps four running values: the greedy argmax, the log-sum-exp of the raw logits (for
the chosen token's log-prob), and the argmax of ``logits / T + G`` with G ~ Gumbel(0, 1) i.i.d. (a
draw from softmax(logits / T), the same distribution as the torch reference's exponential race).
The noise is Philox (``tl.rand``) keyed by a seed drawn from torch's global generator on the
device, so ``torch.manual_seed`` makes draws reproducible and nothing syncs the host.

The torch reference takes the rest: top-k / top-p / min-p filters, per-request generators (their
streams are torch's), and top log-probs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.torch import sampling as reference
from atom_kernels.backends.triton.common import is_interpreted

_SAMPLING_EPS = reference._SAMPLING_EPS


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


@triton.jit
def _sample_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    token_ids_ptr,
    logprobs_ptr,
    vocab_size,
    stride_lb,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
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
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offs
        mask = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=mask, other=neg_inf).to(tl.float32)
        block_max = tl.max(x, axis=0)
        new_max = tl.maximum(run_max, block_max)
        # exp2 of -inf - -inf is NaN: a row (so far) of -inf adds nothing.
        scale = tl.where(new_max == neg_inf, 0.0, tl.exp2((run_max - new_max) * 1.4426950408889634))
        shifted = tl.where(mask & (x > neg_inf), (x - new_max) * 1.4426950408889634, neg_inf)
        run_sum = run_sum * scale + tl.sum(tl.exp2(shifted), axis=0)
        run_max = new_max
        best_raw, best_raw_i = _argmax_merge(best_raw, best_raw_i, x, cols)
        u = tl.rand(seed, row.to(tl.int64) * vocab_size + cols)
        u = tl.maximum(u, 1e-20)  # tl.rand is in [0, 1): log(0) would make an infinite draw
        gumbel = -tl.log(-tl.log(u))
        draw = tl.where(mask & (x > neg_inf), x * inv_t + gumbel, neg_inf)
        best_draw, best_draw_i = _argmax_merge(best_draw, best_draw_i, draw, cols)
    token = tl.where(greedy, best_raw_i, best_draw_i)
    chosen = tl.load(row_ptr + token).to(tl.float32)
    logprob = chosen - run_max - tl.log(run_sum)
    tl.store(token_ids_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, logprob)


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [B] int64, their log-probs [B] fp32): greedy or temperature draws, every row."""
    num_seqs, vocab_size = logits.shape
    token_ids = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_seqs, dtype=torch.float32, device=logits.device)
    if num_seqs:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        # A fresh Philox key per call from torch's generator: on the device, no host sync.
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=logits.device)
        block_v = 64 if is_interpreted(logits.device) else 2048
        _sample_kernel[(num_seqs,)](
            logits,
            temperature.contiguous(),
            seed,
            token_ids,
            logprobs,
            vocab_size,
            logits.stride(0),
            BLOCK_V=min(block_v, triton.next_power_of_2(vocab_size)),
            num_warps=8 if block_v >= 2048 else 4,
        )
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
