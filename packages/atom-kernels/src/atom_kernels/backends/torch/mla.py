"""Torch reference: MLA latent-cache write and attention over the latent cache (one dense masked
softmax per sequence)."""

from __future__ import annotations

import torch

from atom_kernels.backends.torch.cache import dequantize_from_cache, quantize_to_cache_dtype
from atom_kernels.registry import register_op


@register_op("mla_cache_write", "torch")
def mla_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor | None = None,
) -> None:
    block_size, latent_dim = kv_cache.shape[1], kv_c.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, offsets, :latent_dim] = quantize_to_cache_dtype(
        kv_c[keep], kv_cache.dtype, kv_scale
    )
    kv_cache[blocks, offsets, latent_dim:] = quantize_to_cache_dtype(
        k_pe[keep], kv_cache.dtype, kv_scale
    )


@register_op("mla_paged_attention", "torch")
def mla_paged_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    max_query_len: int | None = None,  # a launch hint; the reference needs none
    kv_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    # T = query tokens, H = heads, L = latent dim, S = the sequence's cached tokens
    num_tokens, num_heads, latent_dim = q_latent.shape
    block_size = kv_cache.shape[1]
    result = torch.zeros(
        num_tokens, num_heads, latent_dim, dtype=torch.float32, device=q_latent.device
    )
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(
                f"mla_paged_attention: sequence {b} has {q_len} query rows but seq_lens[{b}] = "
                f"{seq_len}; the new tokens must already be in the cache"
            )
        block_ids = block_tables[b, : -(-seq_len // block_size)].long()
        tokens = kv_cache[block_ids].flatten(0, 1)[:seq_len]
        tokens = dequantize_from_cache(tokens, kv_scale)  # [S, L + R] fp32
        latent, rope = tokens[:, :latent_dim], tokens[:, latent_dim:]
        q_l = q_latent[q_start:q_end].float()  # [q_len, H, L]
        q_r = q_pe[q_start:q_end].float()  # [q_len, H, R]
        scores = torch.einsum("qhl,sl->hqs", q_l, latent)
        scores = (scores + torch.einsum("qhr,sr->hqs", q_r, rope)) * scale  # [H, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q_latent.device)[:, None]
        k_pos = torch.arange(seq_len, device=q_latent.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result[q_start:q_end] = torch.einsum("hqs,sl->qhl", probs, latent)
    if out is None:
        return result.to(q_latent.dtype)
    out.copy_(result)
    return out
