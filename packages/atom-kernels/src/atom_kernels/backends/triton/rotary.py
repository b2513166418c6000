"""Triton rotary embedding (neox / gptj, partial rotary): one token per program row, q and k
head tiles in one launch; returns new tensors. Optionally RMS-normalizes each head first (Qwen3's
q/k norm): three launches (q norm, k norm, rotary) become one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import next_pow2


@triton.jit
def _normed(x, inv, w_ptrs, mask, dtype):
    """As ``rms_norm`` rounds: normalized, rounded to the dtype, times the weight, rounded."""
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    return (w * (x * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _load_heads(
    x_row,
    w_ptr,
    eps,
    head_mask,
    head_dim,
    rotary_dim,
    stride_xd,
    dtype_ptr,
    IS_NEOX: tl.constexpr,
    PARTIAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A tile of heads (``x_row`` [BLOCK_H, 1] pointers, one per head) as fp32 rotation pairs:
    (x1, x2) at dims (i1, i2) under ``mask``, and the pass-through dims ``rest`` at ``d`` under
    ``keep`` (PARTIAL; otherwise x1 / i1 / mask stand in, unused). With HAS_NORM each head is
    RMS-normalized first, rounding to ``dtype_ptr``'s element type as ``rms_norm`` does."""
    half = rotary_dim // 2
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if IS_NEOX:  # halves (x[i], x[i + R/2])
        i1 = i
        i2 = i + half
    else:  # interleaved pairs (x[2i], x[2i + 1])
        i1 = 2 * i
        i2 = 2 * i + 1
    mask = head_mask[:, None] & (i < half)
    x1 = tl.load(x_row + i1 * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2 * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if PARTIAL:  # dims rotary_dim .. head_dim pass through (normalized when HAS_NORM)
        d = tl.arange(0, BLOCK_D)[None, :]
        keep = head_mask[:, None] & (d >= rotary_dim) & (d < head_dim)
        rest = tl.load(x_row + d * stride_xd, mask=keep, other=0.0).to(tl.float32)
    else:
        d = i1
        keep = mask
        rest = x1
    if HAS_NORM:
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PARTIAL:
            squares += tl.sum(rest * rest, axis=1)
        inv = tl.rsqrt(squares / head_dim + eps)[:, None]
        dtype = dtype_ptr.dtype.element_ty
        x1 = _normed(x1, inv, w_ptr + i1, i < half, dtype)
        x2 = _normed(x2, inv, w_ptr + i2, i < half, dtype)
        if PARTIAL:
            rest = _normed(rest, inv, w_ptr + d, (d >= rotary_dim) & (d < head_dim), dtype)
    return x1, x2, i1, i2, mask, rest, d, keep


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    w_ptr,
    eps,
    token,
    head0,
    num_heads,
    head_dim,
    rotary_dim,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_ot,
    stride_oh,
    cos,
    sin,
    IS_NEOX: tl.constexpr,
    PARTIAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # x: [T, heads, head_dim]; this tile: heads head0 .. head0 + BLOCK_H of one token.
    heads = head0 + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    x_row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    out_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    x1, x2, i1, i2, mask, rest, d, keep = _load_heads(
        x_row, w_ptr, eps, head_mask, head_dim, rotary_dim, stride_xd, out_ptr,
        IS_NEOX, PARTIAL, HAS_NORM, BLOCK_HALF, BLOCK_D,
    )  # fmt: skip
    if PARTIAL:
        tl.store(out_row + d, rest, mask=keep)
    tl.store(out_row + i1, x1 * cos - x2 * sin, mask=mask)
    tl.store(out_row + i2, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    cache_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_w_ptr,
    k_w_ptr,
    eps,
    num_q_heads,
    num_k_heads,
    q_head_dim,
    k_head_dim,
    rotary_dim,
    num_q_tiles,
    stride_cp,
    stride_cr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    IS_NEOX: tl.constexpr,
    Q_PARTIAL: tl.constexpr,
    K_PARTIAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_DQ: tl.constexpr,
    BLOCK_DK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = rotary_dim // 2
    i = tl.arange(0, BLOCK_HALF)
    cache_row = cache_ptr + pos * stride_cp
    cos = tl.load(cache_row + i * stride_cr, mask=i < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_row + (i + half) * stride_cr, mask=i < half, other=0.0)
    sin = sin.to(tl.float32)[None, :]
    if tile < num_q_tiles:
        _rotate_heads(
            q_ptr, q_out_ptr, q_w_ptr, eps, token, tile * BLOCK_H, num_q_heads, q_head_dim,
            rotary_dim, stride_qt, stride_qh, stride_qd, stride_qot, stride_qoh, cos, sin,
            IS_NEOX, Q_PARTIAL, HAS_NORM, BLOCK_H, BLOCK_HALF, BLOCK_DQ,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, k_out_ptr, k_w_ptr, eps, token, (tile - num_q_tiles) * BLOCK_H, num_k_heads,
            k_head_dim, rotary_dim, stride_kt, stride_kh, stride_kd, stride_kot, stride_koh, cos,
            sin, IS_NEOX, K_PARTIAL, HAS_NORM, BLOCK_H, BLOCK_HALF, BLOCK_DK,
        )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, H, D]; k [T, Hk, D']; cos_sin_cache [P, R] -> new (q, k); with norm
    weights [D] / [D'], each head is RMS-normalized first."""
    num_tokens, num_q_heads, q_head_dim = q.shape
    num_k_heads, k_head_dim = k.shape[1], k.shape[2]
    rotary_dim = cos_sin_cache.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    block_half = next_pow2(rotary_dim // 2)
    block_d = next_pow2(max(q_head_dim, k_head_dim))
    # About 4K elements of a head tile per program: all of Llama-3-8B's 32 q heads x 64 pairs.
    block_h = min(next_pow2(max(num_q_heads, num_k_heads)), max(1, 4096 // block_d))
    num_q_tiles = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_tiles + triton.cdiv(num_k_heads, block_h))
    _rotary_kernel[grid](
        positions,
        cos_sin_cache,
        q,
        k,
        q_out,
        k_out,
        q_norm_weight if q_norm_weight is not None else cos_sin_cache,
        k_norm_weight if k_norm_weight is not None else cos_sin_cache,
        float(norm_eps),
        num_q_heads,
        num_k_heads,
        q_head_dim,
        k_head_dim,
        rotary_dim,
        num_q_tiles,
        cos_sin_cache.stride(0),
        cos_sin_cache.stride(1),
        *q.stride(),
        *k.stride(),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        IS_NEOX=bool(is_neox),
        Q_PARTIAL=rotary_dim < q_head_dim,
        K_PARTIAL=rotary_dim < k_head_dim,
        HAS_NORM=q_norm_weight is not None,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_DQ=next_pow2(q_head_dim),
        BLOCK_DK=next_pow2(k_head_dim),
        num_warps=4,
    )
    return q_out, k_out
