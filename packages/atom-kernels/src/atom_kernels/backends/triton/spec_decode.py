"""Triton rejection sampling (see atom_kernels.ops.spec_decode): one program per request walks
its drafts in order; the one token it draws (recovery at the first rejection, or the bonus) is an
argmax over the vocabulary in blocks. Given the same `uniform` and `noise`, it returns exactly the
torch reference's tokens."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.registry import register_op

# What the argmax ranks: p (greedy), p / noise (a draw from p), p without the draft token / noise
# (recovery after a one-hot draft), max(p - q, 0) / noise (recovery after a draft with probs q).
_GREEDY, _DRAW, _DRAW_WITHOUT_X, _DRAW_RESIDUAL = 0, 1, 2, 3


@triton.jit
def _argmax_row(p_row, q_row, noise_row, x, V, mode, BLOCK_V: tl.constexpr):
    best_value = -float("inf")
    best_index = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(p_row + offs, mask=mask, other=0.0)
        if mode == 3:
            q = tl.load(q_row + offs, mask=mask, other=0.0)
            p = tl.maximum(p - q, 0.0)
        if mode == 2:
            p = tl.where(offs == x, 0.0, p)
        if mode != 0:
            noise = tl.load(noise_row + offs, mask=mask, other=1.0)
            p = p / noise
        p = tl.where(mask, p, -float("inf"))
        value = tl.max(p, axis=0)
        index = tl.min(tl.where(p == value, offs, V), axis=0)  # the lowest id among ties
        better = value > best_value
        best_index = tl.where(better, index, best_index)
        best_value = tl.where(better, value, best_value)
    return best_index.to(tl.int64)


@triton.jit
def _rejection_kernel(
    target_ptr,
    draft_ids_ptr,
    cu_ptr,
    draft_probs_ptr,
    uniform_ptr,
    noise_ptr,
    greedy_ptr,
    out_ptr,
    num_ptr,
    V,
    out_stride,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0)
    start = tl.load(cu_ptr + i).to(tl.int64)
    k = tl.load(cu_ptr + i + 1).to(tl.int64) - start
    greedy = tl.load(greedy_ptr + i) != 0
    noise_row = noise_ptr + i * V
    row0 = start + i
    accepted = 0
    rejected = 0
    j = 0
    while (j < k) & (rejected == 0):
        x = tl.load(draft_ids_ptr + start + j).to(tl.int64)
        p_row = target_ptr + (row0 + j) * V
        q_row = draft_probs_ptr + (start + j) * V
        if greedy:
            best = _argmax_row(p_row, q_row, noise_row, x, V, 0, BLOCK_V)
            ok = best == x
            recovered = best
        else:
            p_x = tl.load(p_row + x)
            if HAS_DRAFT_PROBS:
                q_x = tl.load(q_row + x)
            else:
                q_x = 1.0
            u = tl.load(uniform_ptr + start + j)
            ok = u * q_x < p_x
            recovered = x
            if not ok:
                if HAS_DRAFT_PROBS:
                    recovered = _argmax_row(p_row, q_row, noise_row, x, V, 3, BLOCK_V)
                else:
                    recovered = _argmax_row(p_row, q_row, noise_row, x, V, 2, BLOCK_V)
        if ok:
            tl.store(out_ptr + i * out_stride + j, x)
            accepted += 1
        else:
            tl.store(out_ptr + i * out_stride + j, recovered)
            rejected = 1
        j += 1
    if rejected == 0:
        p_row = target_ptr + (row0 + k) * V
        if greedy:
            bonus = _argmax_row(p_row, p_row, noise_row, 0, V, 0, BLOCK_V)
        else:
            bonus = _argmax_row(p_row, p_row, noise_row, 0, V, 1, BLOCK_V)
        tl.store(out_ptr + i * out_stride + k, bonus)
    tl.store(num_ptr + i, (accepted + 1).to(tl.int32))


@register_op("rejection_sample", "triton")
def rejection_sample(
    target_probs, draft_token_ids, cu_num_draft, draft_probs, uniform, noise, greedy
):
    batch = cu_num_draft.shape[0] - 1
    counts = cu_num_draft[1:] - cu_num_draft[:-1]
    max_k = int(counts.max().item()) if batch else 0
    vocab = target_probs.shape[1]
    out = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=target_probs.device)
    num = torch.empty(batch, dtype=torch.int32, device=target_probs.device)
    has_q = draft_probs is not None
    _rejection_kernel[(batch,)](
        target_probs.contiguous(),
        draft_token_ids.contiguous(),
        cu_num_draft.contiguous(),
        draft_probs.contiguous() if has_q else target_probs,
        uniform.contiguous(),
        noise.contiguous(),
        greedy.contiguous(),
        out,
        num,
        vocab,
        out.stride(0),
        HAS_DRAFT_PROBS=has_q,
        BLOCK_V=min(4096, triton.next_power_of_2(vocab)),
    )
    return out, num
