"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the latent KV-cache write and attention over
the latent cache, with the key up-projection absorbed into the query.

One cache "head" per token holds the compressed latent c (kv_lora_rank = L, after kv_a_layernorm)
followed by the rope key k_pe (qk_rope_head_dim = R, rotary applied): kv_cache[..., :L] = c,
kv_cache[..., L:] = k_pe. Keys are (c, k_pe) and values are c itself, so every query head attends
over the same cache rows (MQA with one kv head of dim L + R and values of dim L). An fp8 latent
cache has one per-tensor scale, kv_scale, for the latent and the rope key: it stores
clamp(x / kv_scale) in the fp8 range and every read multiplies back."""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    INDEX_DTYPES,
    check_batch_layout,
    check_dim,
    check_max_query_len,
    check_same_device,
    check_scale,
    check_shape,
    check_tensor,
    is_fp8,
)
from atom_kernels.registry import get_op


def _check_latent_cache(
    op: str, kv_cache: torch.Tensor, latent_dim: int, rope_dim: int, kv_scale: object
) -> None:
    check_tensor(op, "kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES)
    if is_fp8(kv_cache.dtype) and kv_scale is None:
        raise ValueError(f"{op}: an {kv_cache.dtype} cache needs kv_scale (a per-tensor scale)")
    if kv_scale is not None:
        check_scale(op, "kv_scale", kv_scale, kv_cache)
    check_dim(
        op,
        "kv_cache",
        kv_cache,
        2,
        latent_dim + rope_dim,
        f"(the latent dim L = {latent_dim} then the rope dim R = {rope_dim})",
    )


def mla_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor | None = None,
) -> None:
    """Write token t's latent and rope key into slot ``slot_mapping[t]`` of the latent cache.

    T = tokens, L = kv_lora_rank, R = qk_rope_head_dim.
    kv_c: [T, L] (after kv_a_layernorm); k_pe: [T, R] (rotary applied); kv_cache:
    [num_blocks, block_size, L + R], written in place: kv_cache[block, offset] = cat(kv_c[t],
    k_pe[t]) cast to the cache's dtype (an fp8 cache: ``clamp(x / kv_scale, fp8 range)``,
    kv_scale a per-tensor float or 1-element tensor); slot_mapping: [T] int64 (or int32), slot
    s -> block s // block_size, offset s % block_size, -1 = skip (padding).
    """
    op = "mla_cache_write"
    check_tensor(op, "kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "k_pe", k_pe, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    num_tokens, latent_dim = kv_c.shape
    check_dim(op, "k_pe", k_pe, 0, num_tokens, "(one row per kv_c row)")
    _check_latent_cache(op, kv_cache, latent_dim, k_pe.shape[1], kv_scale)
    check_shape(op, "slot_mapping", slot_mapping, (num_tokens,), "(one slot per kv_c row)")
    check_same_device(op, "kv_cache", kv_cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    get_op(op, kv_c.device)(kv_c, k_pe, kv_cache, slot_mapping, kv_scale)


def mla_paged_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    kv_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal MLA over the paged latent cache, for a mixed batch of prefills and decodes.

    T = query tokens, B = sequences, H = query heads, L = kv_lora_rank, R = qk_rope_head_dim.
    q_latent: [T, H, L] (q_nope absorbed through W_UK); q_pe: [T, H, R] (rotary applied), same
    dtype; kv_cache: [num_blocks, block_size, L + R] in q's dtype, or fp8 dequantized with
    kv_scale (latent c then rope key k_pe);
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32, tokens of each sequence in the cache,
    the new ones included (already written); query_start_loc: [B + 1] int32, sequence b owns query
    rows qsl[b]:qsl[b+1] (q_len_b rows), row i sitting at position seq_lens[b] - q_len_b + i and
    seeing keys j <= its position. Row t, head h:
    ``softmax_j(scale * (q_latent[t, h] . c_j + q_pe[t, h] . k_pe_j)) @ c``, fp32 math.
    Returns [T, H, L] in q's dtype, written into ``out`` when given; rows past
    query_start_loc[B] are zeroed. ``max_query_len``: the largest q_len_b when the caller knows it
    (a hint, never read from the device): with 1 and T == B (a decode-only batch), backends skip
    their prefill path.
    """
    op = "mla_paged_attention"
    check_tensor(op, "q_latent", q_latent, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "q_pe", q_pe, ndim=3, dtypes=(q_latent.dtype,))
    num_tokens, num_heads, latent_dim = q_latent.shape
    rope_dim = q_pe.shape[2]
    check_shape(op, "q_pe", q_pe, (num_tokens, num_heads, rope_dim), "to match q_latent's (T, H)")
    _check_latent_cache(op, kv_cache, latent_dim, rope_dim, kv_scale)
    if not is_fp8(kv_cache.dtype) and kv_cache.dtype != q_latent.dtype:
        raise ValueError(
            f"{op}: kv_cache has dtype {kv_cache.dtype}, expected {q_latent.dtype} "
            "(q_latent's dtype) or an fp8 dtype"
        )
    check_batch_layout(op, block_tables, seq_lens, query_start_loc)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"{op}: scale must be a float, got {scale!r}")
    check_max_query_len(op, max_query_len)
    if out is not None:
        check_tensor(op, "out", out, ndim=3, dtypes=(q_latent.dtype,))
        check_shape(op, "out", out, (num_tokens, num_heads, latent_dim), "([T, H, L])")
    check_same_device(
        op,
        "q_latent",
        q_latent,
        q_pe=q_pe,
        kv_cache=kv_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        out=out,
    )
    return get_op(op, q_latent.device)(
        q_latent,
        q_pe,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        float(scale),
        out,
        max_query_len,
        kv_scale=kv_scale,
    )
