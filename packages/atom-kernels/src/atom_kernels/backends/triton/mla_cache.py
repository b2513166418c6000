"""Triton MLA latent-cache write: token t's latent and rope key go to slot slot_mapping[t] of the
latent cache as one row (latent then rope key); -1 skips the token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import next_pow2


@triton.jit
def _mla_cache_write_kernel(
    kv_c_ptr,
    k_pe_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
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
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < latent_dim
    c = tl.load(kv_c_ptr + token * stride_ct + offs_l * stride_cd, mask=mask_l)
    tl.store(row_ptr + offs_l * stride_kd, c.to(dtype), mask=mask_l)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rope_dim
    pe = tl.load(k_pe_ptr + token * stride_pt + offs_r * stride_pd, mask=mask_r)
    tl.store(row_ptr + (latent_dim + offs_r) * stride_kd, pe.to(dtype), mask=mask_r)


def mla_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """kv_c [T, L], k_pe [T, R] -> kv_cache [blocks, block_size, L + R] (see
    atom_kernels.mla_cache_write)."""
    num_tokens, latent_dim = kv_c.shape
    rope_dim = k_pe.shape[1]
    if num_tokens == 0:
        return
    block_l, block_r = next_pow2(latent_dim), next_pow2(rope_dim)
    _mla_cache_write_kernel[(num_tokens,)](
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        latent_dim,
        rope_dim,
        kv_cache.shape[1],
        *kv_c.stride(),
        *k_pe.stride(),
        *kv_cache.stride(),
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        num_warps=4 if block_l >= 512 else 1,
    )
