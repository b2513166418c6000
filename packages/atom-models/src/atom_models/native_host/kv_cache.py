"""The model's paged KV cache as the engine sizes and binds it: every `NativeCacheLayer` of the
model in layer order, the bytes one token costs them all, and binding (or releasing) every
layer's cache at once. `PagedKVCache` is the engine's model runner's one handle on it; the
functions do the same for a model used without the engine (tests, examples)."""

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


class PagedKVCache:
    """The model's paged KV cache as its owner (the engine's model runner) holds it: the model's
    cache layers, found once; what a token and a block of `block_size` tokens cost them all in
    `dtype` (the model's, or float8_e4m3fn); every layer's cache bound, or released, at once.
    The runner sizes and binds the cache through this object alone, without knowing the layer
    kinds; `num_blocks` is the count bound now (0: none)."""

    def __init__(self, model: nn.Module, block_size: int, dtype: torch.dtype) -> None:
        self.layers = cache_layers(model)
        self.block_size = block_size
        self.dtype = dtype
        self.bytes_per_token = sum(layer.cache_bytes_per_token(dtype) for layer in self.layers)
        self.block_bytes = self.bytes_per_token * block_size
        self.num_blocks = 0

    def bind(self, num_blocks: int, device: torch.device | str) -> list[tuple[torch.Tensor, ...]]:
        """Allocate (zeroed) and bind every layer's cache of `num_blocks` blocks: (K, V) for
        standard attention, (latent,) for MLA, in layer order."""
        tensors = [
            layer.bind_cache(num_blocks, self.block_size, self.dtype, device)
            for layer in self.layers
        ]
        self.num_blocks = num_blocks
        return tensors

    def release(self) -> None:
        """Drop every layer's cache (the memory profile binds a temporary one; shutdown)."""
        for layer in self.layers:
            layer.release_cache()
        self.num_blocks = 0
