"""Triton KV-cache write: token t's key/value heads go to slot slot_mapping[t] of the paged cache
(-1 skips the token); an fp8 cache stores clamp(x / scale) in the fp8 range."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import fp8_max, next_pow2, scale_args


@triton.jit
def _store_heads(
    src_ptr,
    cache_ptr,
    token,
    cache_offset,
    head0,
    num_heads,
    head_dim,
    stride_st,
    stride_sh,
    stride_sd,
    stride_ch,
    stride_cd,
    scale_ptr,
    scale,
    fp8_max,
    IS_FP8: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = head0 + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (d < head_dim)
    x = tl.load(src_ptr + token * stride_st + heads * stride_sh + d * stride_sd, mask=mask)
    if IS_FP8:
        if SCALE_IS_PTR:
            scale = tl.load(scale_ptr).to(tl.float32)
        # IEEE division (not x * (1 / scale)) so the fp8 rounding matches the torch reference.
        x = tl.math.div_rn(x.to(tl.float32), tl.full(x.shape, scale, tl.float32))
        x = tl.minimum(tl.maximum(x, -fp8_max), fp8_max)
    x = x.to(cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + cache_offset + heads * stride_ch + d * stride_cd, x, mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_scale,
    v_scale,
    fp8_max,
    num_heads,
    head_dim,
    head_dim_v,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    IS_FP8: tl.constexpr,
    K_SCALE_IS_PTR: tl.constexpr,
    V_SCALE_IS_PTR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    offset = slot % block_size
    _store_heads(
        key_ptr, key_cache_ptr, token, block * stride_kcb + offset * stride_kcs, head0,
        num_heads, head_dim, stride_kt, stride_kh, stride_kd, stride_kch, stride_kcd,
        k_scale_ptr, k_scale, fp8_max, IS_FP8, K_SCALE_IS_PTR, BLOCK_H, BLOCK_D,
    )  # fmt: skip
    _store_heads(
        value_ptr, value_cache_ptr, token, block * stride_vcb + offset * stride_vcs, head0,
        num_heads, head_dim_v, stride_vt, stride_vh, stride_vd, stride_vch, stride_vcd,
        v_scale_ptr, v_scale, fp8_max, IS_FP8, V_SCALE_IS_PTR, BLOCK_H, BLOCK_DV,
    )  # fmt: skip


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> None:
    """key [T, Hk, D], value [T, Hk, Dv] -> key_cache / value_cache [blocks, block_size, Hk, *]."""
    num_tokens, num_heads, head_dim = key.shape
    head_dim_v = value.shape[2]
    if num_tokens == 0:
        return
    is_fp8 = key_cache.dtype.itemsize == 1
    k_scale_ptr, k_scale_f, k_is_ptr = scale_args(k_scale, slot_mapping)
    v_scale_ptr, v_scale_f, v_is_ptr = scale_args(v_scale, slot_mapping)
    block_d, block_dv = next_pow2(head_dim), next_pow2(head_dim_v)
    # About 4K elements per program: all of Llama-3-8B's 8 kv heads x 128 dims.
    block_h = min(next_pow2(num_heads), max(1, 4096 // max(block_d, block_dv)))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale_ptr,
        v_scale_ptr,
        k_scale_f,
        v_scale_f,
        fp8_max(key_cache.dtype),
        num_heads,
        head_dim,
        head_dim_v,
        key_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        IS_FP8=is_fp8,
        K_SCALE_IS_PTR=k_is_ptr,
        V_SCALE_IS_PTR=v_is_ptr,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        num_warps=4,
    )
