"""`PagedKVCache`, the engine's handle on a model's paged cache: the bytes it reports are the
layers' own, and it binds and releases every cache layer (standard attention and MLA) at once."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig

from atom_models import load_model
from atom_models.native_host import (
    NativeAttention,
    PagedKVCache,
    bind_kv_cache,
    cache_layers,
    kv_cache_bytes_per_token,
)

TINY = dict(vocab_size=211, hidden_size=64, num_hidden_layers=3, max_position_embeddings=64)
CONFIGS = {
    "llama": LlamaConfig(
        **TINY, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    ),
    "deepseek_v3": DeepseekV3Config(
        **TINY,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=3,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, make_checkpoint):
    path, _ = make_checkpoint(CONFIGS[request.param])
    return load_model(path, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_sizes_are_the_layers_own(model, dtype):
    cache = PagedKVCache(model, block_size=16, dtype=dtype)
    layers = cache_layers(model)
    assert cache.layers == layers
    assert [layer.spec.layer_idx for layer in layers] == [0, 1, 2]
    per_token = sum(layer.cache_bytes_per_token(dtype) for layer in layers)
    assert cache.bytes_per_token == per_token == kv_cache_bytes_per_token(model, dtype)
    assert cache.block_bytes == 16 * per_token
    assert cache.num_blocks == 0


def test_bind_and_release_every_layer_at_once(model):
    cache = PagedKVCache(model, block_size=4, dtype=torch.float32)
    tensors = cache.bind(5, "cpu")
    assert cache.num_blocks == 5
    assert len(tensors) == len(cache.layers) == 3
    total = 0
    for layer, bound in zip(cache.layers, tensors, strict=True):
        caches = (
            (layer.k_cache, layer.v_cache)
            if isinstance(layer, NativeAttention)
            else (layer.kv_cache,)
        )
        assert all(a is b for a, b in zip(caches, bound, strict=True))
        assert all(t.shape[:2] == (5, 4) and not t.any() for t in bound)
        total += sum(t.numel() * t.element_size() for t in bound)
    assert total == 5 * cache.block_bytes
    # the same shapes as the function the model's own tests use
    again = bind_kv_cache(model, 5, 4, torch.float32, "cpu")
    assert [[t.shape for t in b] for b in again] == [[t.shape for t in b] for b in tensors]
    cache.release()
    assert cache.num_blocks == 0
    for layer in cache.layers:
        caches = (
            (layer.k_cache, layer.v_cache)
            if isinstance(layer, NativeAttention)
            else (layer.kv_cache,)
        )
        assert all(c is None for c in caches)
