"""The model's paged KV cache as the engine sizes and binds it: every `NativeCacheLayer` of the
model in layer order, the bytes one token costs them all, and binding (or releasing) every
layer's cache at once."""

from __future__ import annotations

import torch
from torch import nn

from atom_models.native_host.cache_layer import NativeCacheLayer


def cache_layers(model: nn.Module) -> list[NativeCacheLayer]:
    """The model's native attention layers (every kind with a paged cache) in layer order."""
    layers = [m for m in model.modules() if isinstance(m, NativeCacheLayer)]
    return sorted(layers, key=lambda m: m.spec.layer_idx)


def kv_cache_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of paged cache one token takes over all of the model's attention layers."""
    return sum(layer.cache_bytes_per_token(dtype) for layer in cache_layers(model))


def bind_kv_cache(
    model: nn.Module,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, ...]]:
    """Allocate a paged cache for every attention layer and bind it to the layer: (K, V) for
    standard attention, (latent,) for MLA. `dtype`: the model's, or float8_e4m3fn (each layer
    then quantizes with its own per-tensor scales)."""
    return [
        layer.bind_cache(num_blocks, block_size, dtype, device) for layer in cache_layers(model)
    ]


def release_kv_cache(model: nn.Module) -> None:
    """Drop every layer's cache (the runner's memory profile binds a temporary one)."""
    for layer in cache_layers(model):
        layer.release_cache()
