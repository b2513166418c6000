"""Triton MLA latent-cache write: token t's latent and rope key go to slot slot_mapping[t] of the
latent cache as one row (latent then rope key); -1 skips the token. An fp8 cache stores
clamp(x / kv_scale) in the fp8 range."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import fp8_max, next_pow2, scale_args


@triton.jit
def _to_cache(x, scale, fp8_max, dtype: tl.constexpr, IS_FP8: tl.constexpr):
    if IS_FP8:
        # IEEE division (not x * (1 / scale)) so the fp8 rounding matches the torch reference.
        x = tl.math.div_rn(x.to(tl.float32), tl.full(x.shape, scale, tl.float32))
        x = tl.minimum(tl.maximum(x, -fp8_max), fp8_max)
    return x.to(dtype)


@triton.jit
def _mla_cache_write_kernel(
    kv_c_ptr,
    k_pe_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    scale_ptr,
    scale,
    fp8_max,
    latent_dim,
    rope_dim,
    block_size,
    stride_ct,
    stride_cd,
    stride_pt,
    stride_pd,
    stride_kb,
    stride_ks,
    stride_kd,
    IS_FP8: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # T = tokens; kv_c [T, L], k_pe [T, R], kv_cache [blocks, block_size, L + R]; grid (T,)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    row_ptr = kv_cache_ptr + (slot // block_size) * stride_kb + (slot % block_size) * stride_ks
    dtype = kv_cache_ptr.dtype.element_ty
    if IS_FP8 and SCALE_IS_PTR:
        scale = tl.load(scale_ptr).to(tl.float32)
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < latent_dim
    c = tl.load(kv_c_ptr + token * stride_ct + offs_l * stride_cd, mask=mask_l)
    c = _to_cache(c, scale, fp8_max, dtype, IS_FP8)
    tl.store(row_ptr + offs_l * stride_kd, c, mask=mask_l)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rope_dim
    pe = tl.load(k_pe_ptr + token * stride_pt + offs_r * stride_pd, mask=mask_r)
    pe = _to_cache(pe, scale, fp8_max, dtype, IS_FP8)
    tl.store(row_ptr + (latent_dim + offs_r) * stride_kd, pe, mask=mask_r)


def mla_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor | None = None,
) -> None:
    """kv_c [T, L], k_pe [T, R] -> kv_cache [blocks, block_size, L + R] (see
    atom_kernels.mla_cache_write)."""
    num_tokens, latent_dim = kv_c.shape
    rope_dim = k_pe.shape[1]
    if num_tokens == 0:
        return
    block_l, block_r = next_pow2(latent_dim), next_pow2(rope_dim)
    scale_ptr, scale, scale_is_ptr = scale_args(kv_scale, slot_mapping)
    _mla_cache_write_kernel[(num_tokens,)](
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        scale_ptr,
        scale,
        fp8_max(kv_cache.dtype),
        latent_dim,
        rope_dim,
        kv_cache.shape[1],
        *kv_c.stride(),
        *k_pe.stride(),
        *kv_cache.stride(),
        IS_FP8=kv_cache.dtype.itemsize == 1,
        SCALE_IS_PTR=scale_is_ptr,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        num_warps=4 if block_l >= 512 else 1,
    )
