"""Attention over the paged KV cache: a mixed batch of prefills (with a cached prefix) and
decodes."""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import (
    FLOAT_DTYPES,
    check_batch_layout,
    check_dim,
    check_max_query_len,
    check_same_device,
    check_shape,
    check_tensor,
    is_fp8,
)
from atom_kernels.ops.cache import check_paged_cache
from atom_kernels.registry import get_op


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    soft_cap: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's KV in the paged cache.

    T = query tokens, B = sequences, H = query heads, Hk = kv heads, D / Dv = key / value head dims.
    query: [T, H, D]; key_cache: [num_blocks, block_size, Hk, D]; value_cache: [..., Hk, Dv]
    (fp8 caches dequantized with k_scale / v_scale); block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32, KV tokens of each sequence, the new ones included (already cached);
    query_start_loc: [B + 1] int32, sequence b owns query rows qsl[b]:qsl[b+1] (q_len_b rows),
    row i sitting at position seq_lens[b] - q_len_b + i and seeing keys j <= its position
    (and pos - j < sliding_window when given). GQA/MQA: query head h reads kv head h // (H // Hk).
    scores = scale * q.k, then ``soft_cap * tanh(scores / soft_cap)`` when given; ``sinks`` [H]:
    a per-head logit that joins the softmax denominator only. fp32 math. Returns [T, H, Dv] in
    query's dtype, written into ``out`` when given; rows past query_start_loc[B] are zeroed.
    ``max_query_len``: the largest q_len_b when the caller knows it (a hint, never read from the
    device): with 1 and T == B (a decode-only batch), backends skip their prefill path.
    """
    op = "paged_attention"
    check_tensor(op, "query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_paged_cache(op, key_cache, value_cache, k_scale, v_scale)
    check_batch_layout(op, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, head_dim_v = key_cache.shape[2], value_cache.shape[3]
    if not is_fp8(key_cache.dtype) and key_cache.dtype != query.dtype:
        raise ValueError(
            f"{op}: key_cache has dtype {key_cache.dtype}, expected {query.dtype} (query's dtype) "
            "or an fp8 dtype"
        )
    check_dim(op, "key_cache", key_cache, 3, head_dim, "to match query's head dim")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{op}: query has {num_heads} heads, not a multiple of key_cache's "
            f"{num_kv_heads} kv heads"
        )
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"{op}: scale must be a float, got {scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(
            f"{op}: sliding_window must be a positive int or None, got {sliding_window!r}"
        )
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        raise ValueError(f"{op}: soft_cap must be a positive float or None, got {soft_cap!r}")
    if sinks is not None:
        check_tensor(op, "sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES)
        check_shape(op, "sinks", sinks, (num_heads,), "(one per query head)")
    check_max_query_len(op, max_query_len)
    if out is not None:
        check_tensor(op, "out", out, ndim=3, dtypes=(query.dtype,))
        check_shape(op, "out", out, (num_tokens, num_heads, head_dim_v), "([T, H, Dv])")
    check_same_device(
        op,
        "query",
        query,
        key_cache=key_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        sinks=sinks,
        out=out,
    )
    return get_op(op, query.device)(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        float(scale),
        sliding_window,
        sinks,
        None if soft_cap is None else float(soft_cap),
        k_scale,
        v_scale,
        out,
        max_query_len,
    )
