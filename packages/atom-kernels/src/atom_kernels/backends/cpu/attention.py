"""CPU: attention over the paged KV cache.

The torch reference loops over sequences in Python: at decode that is a dozen small ATen calls per
sequence per layer, and the per-call overhead, not the arithmetic, is the step's cost. Here:

- every decode row (a sequence with one query row) of the batch is one padded, masked attention:
  one gather of the sequences' blocks, one matmul for the scores and one for the output;
- a sequence with several query rows (a prefill chunk, with or without a cached prefix) is one
  call of torch's fused CPU attention (`scaled_dot_product_attention`, flash-style, no [q, L]
  probability matrix in memory), or the reference's math where SDPA has no equivalent
  (attention sinks, a soft cap).

Same semantics as the torch reference (`atom_kernels.ops.attention.paged_attention`), fp32 math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.backends.torch import attention as reference
from atom_kernels.backends.torch.cache import dequantize_from_cache
from atom_kernels.registry import register_op


def _decode_rows(
    query: torch.Tensor,  # [b, H, D] one row per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [b, max_blocks]
    seq_lens: torch.Tensor,  # [b]
    max_seq_len: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    soft_cap: float | None,
    k_scale,
    v_scale,
) -> torch.Tensor:
    # b = sequences, L = longest context, Hk = kv heads, G = query heads per kv head
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-max_seq_len // block_size)
    seq_lens = seq_lens.long()
    # Table entries past a sequence's last block may hold anything: read block 0 there (masked).
    block_pos = torch.arange(num_blocks)
    used = block_pos[None, :] < (seq_lens[:, None] + block_size - 1) // block_size
    blocks = torch.where(used, block_tables[:, :num_blocks].long(), 0)  # [b, nb]
    k = key_cache[blocks].flatten(1, 2)[:, :max_seq_len]  # [b, L, Hk, D]
    v = value_cache[blocks].flatten(1, 2)[:, :max_seq_len]  # [b, L, Hk, Dv]
    k = dequantize_from_cache(k, k_scale)
    v = dequantize_from_cache(v, v_scale)
    k_pos = torch.arange(max_seq_len)[None, :]  # [1, L]
    visible = k_pos < seq_lens[:, None]  # [b, L]
    if sliding_window is not None:
        visible &= (seq_lens[:, None] - 1) - k_pos < sliding_window
    # Masked slots can hold any bytes (NaN included): zero their values so 0 * v stays 0.
    v = torch.where(visible[:, :, None, None], v, 0.0)
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale  # [b, Hk, G, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, group, 1).expand(num_seqs, -1, -1, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.transpose(1, 2))  # [b, Hk, G, Dv]
    return out.view(num_seqs, num_heads, -1)


def _prefill_one(
    query: torch.Tensor,  # [q_len, H, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    k_scale,
    v_scale,
) -> torch.Tensor:
    q_len, num_heads, _ = query.shape
    k = dequantize_from_cache(key_cache[block_ids].flatten(0, 1)[:seq_len], k_scale)  # [L, Hk, D]
    v = dequantize_from_cache(value_cache[block_ids].flatten(0, 1)[:seq_len], v_scale)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos  # [q_len, L]
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1)[None],  # [1, H, q_len, D]
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=visible,
        scale=scale,
        enable_gqa=k.shape[1] != num_heads,
    )
    return out[0].transpose(0, 1)  # [q_len, H, Dv]


@register_op("paged_attention", "cpu")
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
    max_query_len: int | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, _ = query.shape
    head_dim_v = value_cache.shape[3]
    block_size = key_cache.shape[1]
    result = out if out is not None else query.new_empty(num_tokens, num_heads, head_dim_v)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    for b, (q_len, seq_len) in enumerate(zip(q_lens, lens, strict=True)):
        if q_len > seq_len:
            raise ValueError(
                f"paged_attention: sequence {b} has {q_len} query rows but seq_lens[{b}] = "
                f"{seq_len}; the new tokens must already be in the cache"
            )
    if starts[-1] < num_tokens:  # padding rows
        result[starts[-1] :].zero_()
    decodes = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if decodes:
        if len(decodes) == len(q_lens):  # a decode-only batch: rows 0..B-1 in order
            seqs, rows = slice(None), slice(0, len(decodes))
        else:
            seqs = torch.tensor(decodes)
            rows = torch.tensor([starts[b] for b in decodes])
        o = _decode_rows(
            query[rows], key_cache, value_cache, block_tables[seqs], seq_lens[seqs],
            max(lens[b] for b in decodes), scale, sliding_window, sinks, soft_cap, k_scale,
            v_scale,
        )  # fmt: skip
        result[rows] = o.to(result.dtype)
    for b, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        q_start, seq_len = starts[b], lens[b]
        if sinks is not None or soft_cap is not None:  # no SDPA equivalent: the reference math
            o = reference.paged_attention(
                query[q_start : q_start + q_len], key_cache, value_cache, block_tables[b : b + 1],
                seq_lens[b : b + 1], query_start_loc.new_tensor([0, q_len]), scale,
                sliding_window, sinks, soft_cap, k_scale, v_scale, None,
            )  # fmt: skip
        else:
            block_ids = block_tables[b, : -(-seq_len // block_size)].long()
            o = _prefill_one(
                query[q_start : q_start + q_len], key_cache, value_cache, block_ids, seq_len,
                scale, sliding_window, k_scale, v_scale,
            )  # fmt: skip
        result[q_start : q_start + q_len] = o.to(result.dtype)
    return result
