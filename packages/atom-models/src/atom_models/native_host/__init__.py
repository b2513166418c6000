"""ATOM's own attention host: the attention layers of a model the engine runs, each over a paged
KV cache the engine sizes and binds, computed with atom_kernels. vLLM and SGLang bring their own
hosts (the plugins); this one is `atom_models.layers.attention.get_attention_host()`'s default.

It lives in atom_models, not beside the engine that owns the cache: a model built outside any
host (this package's tests, the loaders) gets these layers, and atom_engine depends on
atom_models, never the reverse. Everything the engine's cache and graphs touch of the model's
attention is here, behind the names below.

    module          owns
    host.py         NativeAttentionHost: what `load_model(host=...)` builds the layers with
    cache_layer.py  NativeCacheLayer (a layer kind with a paged cache: its bytes a token, its
                    bind/release, its fp8 scales), intercept_attention (the piecewise graphs' seam)
    attention.py    NativeAttention: the K/V cache write and paged attention, its custom op
                    (`atom::native_attention`) under torch.compile, the fused rotary + cache write
    mla.py          NativeMLAAttention: the latent cache, absorbed / expanded; set_mla_mode;
                    flashinfer_mla_decode (FlashInfer's planned decode, where asked for)
    metadata.py     PagedAttentionMetadata: a step's slots, block tables and lengths
    decode_step.py  the CPU's decode-only step plan, shared by a step's layers
    kv_cache.py     the model's whole cache: PagedKVCache (the runner's handle), and the same
                    as functions (bind_kv_cache, ...) for models used without an engine

What the engine calls (atom_engine's model runner, graphs and CPU compile):

    model = load_model(..., host=NativeAttentionHost(builds_mtp_layers=...))
    cache = PagedKVCache(model, block_size, kv_cache_dtype)   the layers, found once
    cache.block_bytes                                 sizing (CPU space, GPU memory profile)
    cache.bind(num_blocks, device), cache.release()   the profile's temporary cache, the real one,
                                                      shutdown
    with set_forward_context(PagedAttentionMetadata.build(...)): model(...)   each step
    intercept_attention(fn), cache_layers(model)      the CUDA graphs, the CPU compile

Imports run one way: metadata, decode_step and cache_layer import nothing of this package;
attention and mla import them; host and kv_cache sit on top.
"""

from atom_models.native_host.attention import NativeAttention
from atom_models.native_host.cache_layer import (
    KV_CACHE_FP8_DTYPES,
    NativeCacheLayer,
    intercept_attention,
)
from atom_models.native_host.host import NativeAttentionHost
from atom_models.native_host.kv_cache import (
    PagedKVCache,
    bind_kv_cache,
    cache_layers,
    kv_cache_bytes_per_token,
    release_kv_cache,
)
from atom_models.native_host.metadata import PagedAttentionMetadata
from atom_models.native_host.mla import NativeMLAAttention, flashinfer_mla_decode, set_mla_mode

__all__ = [
    "KV_CACHE_FP8_DTYPES",
    "NativeAttention",
    "NativeAttentionHost",
    "NativeCacheLayer",
    "NativeMLAAttention",
    "PagedAttentionMetadata",
    "PagedKVCache",
    "bind_kv_cache",
    "cache_layers",
    "intercept_attention",
    "kv_cache_bytes_per_token",
    "release_kv_cache",
    "flashinfer_mla_decode",
    "set_mla_mode",
]
