"""Torch reference: attention over the paged KV cache (one dense masked softmax per sequence)."""

from __future__ import annotations

import torch

from atom_kernels.backends.torch.cache import dequantize_from_cache
from atom_kernels.registry import register_op


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scale) -> torch.Tensor:
    # cache: [num_blocks, block_size, Hk, D] -> the sequence's first seq_len tokens [L, Hk, D] fp32
    tokens = cache[block_ids].flatten(0, 1)[:seq_len]
    return dequantize_from_cache(tokens, scale)


@register_op("paged_attention", "torch")
def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    soft_cap: float | None,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    out: torch.Tensor | None,
    max_query_len: int | None = None,  # a launch hint; the reference needs none
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    result = torch.zeros(
        num_tokens, num_heads, value_cache.shape[3], dtype=torch.float32, device=query.device
    )
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(
                f"paged_attention: sequence {b} has {q_len} query rows but seq_lens[{b}] = "
                f"{seq_len}; the new tokens must already be in the cache"
            )
        block_ids = block_tables[b, : -(-seq_len // block_size)].long()
        k = _gather(key_cache, block_ids, seq_len, k_scale)  # [L, Hk, D]
        v = _gather(value_cache, block_ids, seq_len, v_scale)  # [L, Hk, Dv]
        q = query[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qkgd,lkd->kgql", q, k) * scale  # [Hk, G, q_len, L]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            # The sink is one more logit per head in the denominator, with no value attached.
            sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("kgql,lkd->qkgd", probs, v)  # [q_len, Hk, G, Dv]
        result[q_start:q_end] = o.reshape(q_len, num_heads, -1)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out
