"""KV-cache write: scatter the new tokens' keys and values into the paged cache."""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_same_device,
    check_scale,
    check_shape,
    check_tensor,
    is_fp8,
)
from atom_kernels.registry import get_op

CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def check_paged_cache(
    op: str, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: object, v_scale: object
) -> None:
    """key_cache [num_blocks, block_size, Hk, D], value_cache [num_blocks, block_size, Hk, Dv]."""
    check_tensor(op, "key_cache", key_cache, ndim=4, dtypes=CACHE_DTYPES)
    check_tensor(op, "value_cache", value_cache, ndim=4, dtypes=CACHE_DTYPES)
    if key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(
            f"{op}: value_cache has shape {tuple(value_cache.shape)}, expected "
            f"{tuple(key_cache.shape[:3]) + (value_cache.shape[3],)} to match key_cache's "
            "(num_blocks, block_size, Hk)"
        )
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"{op}: value_cache has dtype {value_cache.dtype}, expected {key_cache.dtype} "
            "(the dtype of key_cache)"
        )
    check_same_device(op, "key_cache", key_cache, value_cache=value_cache)
    if is_fp8(key_cache.dtype):
        if k_scale is None or v_scale is None:
            raise ValueError(
                f"{op}: an {key_cache.dtype} cache needs k_scale and v_scale (per-tensor scales)"
            )
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:
            check_scale(op, name, scale, key_cache)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Write token t's key/value into slot ``slot_mapping[t]`` of the paged cache, in place.

    T = tokens, Hk = kv heads, D / Dv = key / value head dims.
    key: [T, Hk, D]; value: [T, Hk, Dv]; key_cache: [num_blocks, block_size, Hk, D];
    value_cache: [num_blocks, block_size, Hk, Dv]; slot_mapping: [T] int64 (or int32), slot s ->
    block s // block_size, offset s % block_size, -1 = skip (padding). fp32/bf16/fp16 caches store
    the values as they are (cast to the cache dtype); an fp8 cache stores
    ``clamp(key / k_scale, fp8 range)`` (k_scale, v_scale: per-tensor float or 1-element tensor).
    """
    op = "reshape_and_cache"
    check_tensor(op, "key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "value", value, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    check_paged_cache(op, key_cache, value_cache, k_scale, v_scale)
    num_tokens, num_kv_heads = key.shape[0], key_cache.shape[2]
    check_shape(
        op,
        "key",
        key,
        (num_tokens, num_kv_heads, key_cache.shape[3]),
        "to match key_cache's (Hk, D)",
    )
    check_shape(
        op,
        "value",
        value,
        (num_tokens, num_kv_heads, value_cache.shape[3]),
        "to match key's T and value_cache's (Hk, Dv)",
    )
    check_dim(op, "slot_mapping", slot_mapping, 0, num_tokens, "(one slot per key row)")
    check_same_device(op, "key_cache", key_cache, key=key, value=value, slot_mapping=slot_mapping)
    get_op(op, key.device)(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
