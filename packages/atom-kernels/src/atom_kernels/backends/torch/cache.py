"""Torch reference: KV-cache write."""

from __future__ import annotations

import torch

from atom_kernels.registry import register_op


def quantize_to_cache_dtype(
    x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor | None
) -> torch.Tensor:
    """x in the cache's dtype: fp8 stores clamp(x / scale) in the fp8 range, others cast as is."""
    if dtype.itemsize != 1:
        return x.to(dtype)
    scale_f = scale.float() if isinstance(scale, torch.Tensor) else float(scale)
    fp8_max = torch.finfo(dtype).max
    return (x.float() / scale_f).clamp(-fp8_max, fp8_max).to(dtype)


def dequantize_from_cache(x: torch.Tensor, scale: float | torch.Tensor | None) -> torch.Tensor:
    """fp32 values of cache entries x (fp8 entries multiplied back by their scale)."""
    if x.dtype.itemsize != 1:
        return x.float()
    scale_f = scale.float() if isinstance(scale, torch.Tensor) else float(scale)
    return x.float() * scale_f


@register_op("reshape_and_cache", "torch")
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> None:
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = quantize_to_cache_dtype(key[keep], key_cache.dtype, k_scale)
    value_cache[blocks, offsets] = quantize_to_cache_dtype(value[keep], value_cache.dtype, v_scale)
