"""Triton rotary embedding with the KV-cache write in the same launch: q is rotated into a new
tensor; k is rotated (after its per-head RMSNorm, with Qwen3's q/k norms) and written, with v,
straight into slot ``slot_mapping[t]`` of the paged cache (-1 skips the token's K/V).

Unfused, an attention layer launches ``rotary_embedding`` (q, k -> new q, k) and then
``reshape_and_cache`` (k, v -> cache): two launches a layer, and the rotated k makes a round trip
through memory. Here the grid is (tokens, q tiles + k tiles + v tiles): a q tile is the rotary
kernel's, a k tile rotates and stores into the key cache, a v tile copies into the value cache.
Rounding is the unfused pair's: rotated k is rounded to k's dtype, then to the cache's (an fp8
cache stores clamp(x / k_scale) with an IEEE division, as ``reshape_and_cache``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.cache import _store_heads
from atom_kernels.backends.triton.common import fp8_max, next_pow2, scale_args
from atom_kernels.backends.triton.rotary import _load_heads


@triton.jit
def _to_cache(x, scale_ptr, scale, fp8_max, IS_FP8: tl.constexpr, SCALE_IS_PTR: tl.constexpr):
    """x (fp32, already rounded to the source dtype) as ``reshape_and_cache`` stores it."""
    if IS_FP8:
        if SCALE_IS_PTR:
            scale = tl.load(scale_ptr).to(tl.float32)
        x = tl.math.div_rn(x, tl.full(x.shape, scale, tl.float32))
        x = tl.minimum(tl.maximum(x, -fp8_max), fp8_max)
    return x


@triton.jit
def _rotate_store(
    x_ptr,
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
    out_base,
    stride_oh,
    stride_od,
    cos,
    sin,
    scale_ptr,
    scale,
    fp8_max,
    IS_NEOX: tl.constexpr,
    PARTIAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    IS_FP8: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # x: [T, heads, head_dim]; this tile: heads head0 .. head0 + BLOCK_H of one token, written
    # at out_base + head * stride_oh + d * stride_od (a row of q_out, or a cache slot).
    heads = head0 + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    x_row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    out_row = out_base + heads[:, None] * stride_oh
    dtype = x_ptr.dtype.element_ty
    x1, x2, i1, i2, mask, rest, d, keep = _load_heads(
        x_row, w_ptr, eps, head_mask, head_dim, rotary_dim, stride_xd, x_ptr,
        IS_NEOX, PARTIAL, HAS_NORM, BLOCK_HALF, BLOCK_D,
    )  # fmt: skip
    out_dtype = out_base.dtype.element_ty
    # Rounded to x's dtype first: what the unfused rotary hands the cache write.
    y1 = (x1 * cos - x2 * sin).to(dtype).to(tl.float32)
    y2 = (x2 * cos + x1 * sin).to(dtype).to(tl.float32)
    y1 = _to_cache(y1, scale_ptr, scale, fp8_max, IS_FP8, SCALE_IS_PTR)
    y2 = _to_cache(y2, scale_ptr, scale, fp8_max, IS_FP8, SCALE_IS_PTR)
    if PARTIAL:
        rest = _to_cache(rest, scale_ptr, scale, fp8_max, IS_FP8, SCALE_IS_PTR)
        tl.store(out_row + d * stride_od, rest.to(out_dtype), mask=keep)
    tl.store(out_row + i1 * stride_od, y1.to(out_dtype), mask=mask)
    tl.store(out_row + i2 * stride_od, y2.to(out_dtype), mask=mask)


@triton.jit
def _rotary_cache_kernel(
    positions_ptr,
    cos_sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    q_w_ptr,
    k_w_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_scale,
    v_scale,
    fp8_max,
    eps,
    num_q_heads,
    num_kv_heads,
    q_head_dim,
    k_head_dim,
    v_head_dim,
    rotary_dim,
    block_size,
    num_q_tiles,
    num_kv_tiles,
    stride_cp,
    stride_cr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_qot,
    stride_qoh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    IS_NEOX: tl.constexpr,
    Q_PARTIAL: tl.constexpr,
    K_PARTIAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    IS_FP8: tl.constexpr,
    K_SCALE_IS_PTR: tl.constexpr,
    V_SCALE_IS_PTR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_DQ: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # launched behind the QKV GEMM (pdl.py; ATOM_PDL=0: off): nothing read before this
        pdl.wait_for_previous()
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = rotary_dim // 2
    i = tl.arange(0, BLOCK_HALF)
    cos_sin_row = cos_sin_ptr + pos * stride_cp
    cos = tl.load(cos_sin_row + i * stride_cr, mask=i < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_row + (i + half) * stride_cr, mask=i < half, other=0.0)
    sin = sin.to(tl.float32)[None, :]
    if tile < num_q_tiles:
        _rotate_store(
            q_ptr, q_w_ptr, eps, token, tile * BLOCK_H, num_q_heads, q_head_dim, rotary_dim,
            stride_qt, stride_qh, stride_qd, q_out_ptr + token * stride_qot, stride_qoh, 1,
            cos, sin, k_scale_ptr, 1.0, fp8_max,
            IS_NEOX, Q_PARTIAL, HAS_NORM, False, False, BLOCK_H, BLOCK_HALF, BLOCK_DQ,
        )  # fmt: skip
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: a padding token, nothing cached
            block = slot // block_size
            offset = slot % block_size
            kv_tile = tile - num_q_tiles
            if kv_tile < num_kv_tiles:
                _rotate_store(
                    k_ptr, k_w_ptr, eps, token, kv_tile * BLOCK_H, num_kv_heads, k_head_dim,
                    rotary_dim, stride_kt, stride_kh, stride_kd,
                    key_cache_ptr + block * stride_kcb + offset * stride_kcs, stride_kch,
                    stride_kcd, cos, sin, k_scale_ptr, k_scale, fp8_max,
                    IS_NEOX, K_PARTIAL, HAS_NORM, IS_FP8, K_SCALE_IS_PTR, BLOCK_H, BLOCK_HALF,
                    BLOCK_DK,
                )  # fmt: skip
            else:
                _store_heads(
                    v_ptr, value_cache_ptr, token, block * stride_vcb + offset * stride_vcs,
                    (kv_tile - num_kv_tiles) * BLOCK_H, num_kv_heads, v_head_dim, stride_vt,
                    stride_vh, stride_vd, stride_vch, stride_vcd, v_scale_ptr, v_scale, fp8_max,
                    IS_FP8, V_SCALE_IS_PTR, BLOCK_H, BLOCK_DV,
                )  # fmt: skip


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """positions [T]; q [T, H, D]; k [T, Hk, D]; v [T, Hk, Dv]; caches [blocks, block_size, Hk,
    D / Dv] -> new rotated q [T, H, D]; rotated k and v written into the caches."""
    num_tokens, num_q_heads, q_head_dim = q.shape
    num_kv_heads, k_head_dim, v_head_dim = k.shape[1], k.shape[2], v.shape[2]
    rotary_dim = cos_sin_cache.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    k_scale_ptr, k_scale_f, k_is_ptr = scale_args(k_scale, slot_mapping)
    v_scale_ptr, v_scale_f, v_is_ptr = scale_args(v_scale, slot_mapping)
    block_d = next_pow2(max(q_head_dim, k_head_dim, v_head_dim))
    # About 4K elements of a head tile per program, as the rotary and cache kernels.
    block_h = min(next_pow2(max(num_q_heads, num_kv_heads)), max(1, 4096 // block_d))
    num_q_tiles = triton.cdiv(num_q_heads, block_h)
    num_kv_tiles = triton.cdiv(num_kv_heads, block_h)
    grid = (num_tokens, num_q_tiles + 2 * num_kv_tiles)
    use_pdl = pdl.enabled(q.device)
    _rotary_cache_kernel[grid](
        positions,
        cos_sin_cache,
        q,
        k,
        v,
        q_out,
        key_cache,
        value_cache,
        slot_mapping,
        q_norm_weight if q_norm_weight is not None else cos_sin_cache,
        k_norm_weight if k_norm_weight is not None else cos_sin_cache,
        k_scale_ptr,
        v_scale_ptr,
        k_scale_f,
        v_scale_f,
        fp8_max(key_cache.dtype),
        float(norm_eps),
        num_q_heads,
        num_kv_heads,
        q_head_dim,
        k_head_dim,
        v_head_dim,
        rotary_dim,
        key_cache.shape[1],
        num_q_tiles,
        num_kv_tiles,
        cos_sin_cache.stride(0),
        cos_sin_cache.stride(1),
        *q.stride(),
        *k.stride(),
        *v.stride(),
        q_out.stride(0),
        q_out.stride(1),
        *key_cache.stride(),
        *value_cache.stride(),
        IS_NEOX=bool(is_neox),
        Q_PARTIAL=rotary_dim < q_head_dim,
        K_PARTIAL=rotary_dim < k_head_dim,
        HAS_NORM=q_norm_weight is not None,
        IS_FP8=key_cache.dtype.itemsize == 1,
        K_SCALE_IS_PTR=k_is_ptr,
        V_SCALE_IS_PTR=v_is_ptr,
        BLOCK_H=block_h,
        BLOCK_HALF=next_pow2(rotary_dim // 2),
        BLOCK_DQ=next_pow2(q_head_dim),
        BLOCK_DK=next_pow2(k_head_dim),
        BLOCK_DV=next_pow2(v_head_dim),
        USE_PDL=use_pdl,
        num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return q_out
