"""CPU: KV-cache write as one index_copy_ per cache over the flattened slots."""

from __future__ import annotations

import torch

from atom_kernels.backends.cpu.step_memo import per_step
from atom_kernels.backends.torch import cache as reference
from atom_kernels.backends.torch.cache import quantize_to_cache_dtype
from atom_kernels.registry import register_op


def slot_view(cache: torch.Tensor) -> torch.Tensor | None:
    """[num_blocks, block_size, Hk, D] -> [num_blocks * block_size, Hk, D] sharing storage, or
    None when the cache's layout cannot be flattened without a copy (a strided K/V view)."""
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError:
        return None


def _write_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the slots written, int64; the rows kept, or None when every row has a slot)."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        return slots[keep], keep
    return slots, None


@register_op("reshape_and_cache", "cpu")
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> None:
    flat_k, flat_v = slot_view(key_cache), slot_view(value_cache)
    if flat_k is None or flat_v is None:
        reference.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )
        return
    slots, keep = per_step("write_slots", (slot_mapping,), (), lambda: _write_slots(slot_mapping))
    if keep is not None:  # padded rows (slot -1) write nothing
        key, value = key[keep], value[keep]
    for flat, x, scale in ((flat_k, key, k_scale), (flat_v, value, v_scale)):
        stored = quantize_to_cache_dtype(x, flat.dtype, scale)
        if flat.dtype.itemsize == 1:  # index_copy_ has no fp8 kernel: copy the bytes
            flat, stored = flat.view(torch.uint8), stored.view(torch.uint8)
        flat.index_copy_(0, slots, stored)
