"""CPU: attention over the paged KV cache.

The torch reference loops over sequences in Python: at decode that is a dozen small ATen calls per
sequence per layer, and the per-call overhead, not the arithmetic, is the step's cost. Here:

- every decode row (a sequence with one query row) of the batch is one padded, masked attention:
  one gather of the sequences' cache slots per cache and one call of torch's fused CPU attention
  (`scaled_dot_product_attention`), the query heads sharing a KV head taken as its query rows;
  what the gather reads (each key position's slot, invisible positions redirected to the
  sequence's last token) and the additive mask are computed once per step (`_DecodePlan`, kept
  by `step_memo`), not once per layer: every layer of a step passes the same metadata tensors;
- a sequence with several query rows (a prefill chunk, with or without a cached prefix) is one
  call of torch's fused CPU attention (`scaled_dot_product_attention`, flash-style, no [q, L]
  probability matrix in memory), or the reference's math where SDPA has no equivalent
  (attention sinks, a soft cap).

Same semantics as the torch reference (`atom_kernels.ops.attention.paged_attention`), fp32 math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom_kernels.backends.cpu.cache import slot_view
from atom_kernels.backends.cpu.step_memo import per_step
from atom_kernels.backends.torch import attention as reference
from atom_kernels.backends.torch.cache import dequantize_from_cache
from atom_kernels.registry import register_op


@dataclass
class _DecodePlan:
    """What every layer's decode attention of one step shares. b = decode sequences, L = longest
    context among them."""

    slots: torch.Tensor  # [b * L] int64: the cache slot of each (sequence, key position)
    bias: torch.Tensor  # [b, 1, 1, L] float32: 0 where the position is visible, -inf elsewhere
    max_seq_len: int


def _decode_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    decodes: tuple[int, ...] | None,  # the decode sequences, None: all of them
    max_seq_len: int,
    block_size: int,
    sliding_window: int | None,
) -> _DecodePlan:
    if decodes is not None:
        index = torch.tensor(decodes)
        block_tables, seq_lens = block_tables[index], seq_lens[index]
    lens = seq_lens.long()[:, None]  # [b, 1]
    pos = torch.arange(max_seq_len)[None, :]  # [1, L]
    visible = pos < lens  # [b, L]
    if sliding_window is not None:
        visible &= (lens - 1) - pos < sliding_window
    # An invisible position reads the sequence's last token instead (always written, finite), so
    # no garbage (NaN included) of a slot past the table or outside the window reaches the
    # matmuls; the mask gives it probability 0 exactly.
    pos = torch.where(visible, pos, lens - 1)
    blocks = block_tables.long().gather(1, pos // block_size)  # [b, L]
    slots = (blocks * block_size + pos % block_size).reshape(-1)
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    return _DecodePlan(slots, bias, max_seq_len)


def _layout(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[list, list, list]:
    """(query row starts, sequence lengths, query lengths) on the host, checked."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    for b, (q_len, seq_len) in enumerate(zip(q_lens, lens, strict=True)):
        if q_len > seq_len:
            raise ValueError(
                f"paged_attention: sequence {b} has {q_len} query rows but seq_lens[{b}] = "
                f"{seq_len}; the new tokens must already be in the cache"
            )
    return starts, lens, q_lens


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if cache.dtype.itemsize == 1:  # fp8: index_select has no kernel for it; move the bytes
        return cache.view(torch.uint8).index_select(0, slots).view(cache.dtype)
    return cache.index_select(0, slots)


def _decode_rows_sdpa(
    query: torch.Tensor,  # [b, H, D] one row per sequence
    key_cache: torch.Tensor,  # [num_blocks * block_size, Hk, D]: the cache's slot view
    value_cache: torch.Tensor,  # [num_blocks * block_size, Hk, Dv]
    plan: _DecodePlan,
    scale: float,
    k_scale,
    v_scale,
) -> torch.Tensor:
    # b = sequences, L = longest context, Hk = kv heads, G = query heads per kv head
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group, length = num_heads // num_kv_heads, plan.max_seq_len
    k = dequantize_from_cache(_gather_slots(key_cache, plan.slots), k_scale)  # [b * L, Hk, D]
    v = dequantize_from_cache(_gather_slots(value_cache, plan.slots), v_scale)
    out = F.scaled_dot_product_attention(
        query.float().view(num_seqs, num_kv_heads, group, head_dim),  # [b, Hk, G, D]
        k.view(num_seqs, length, num_kv_heads, -1).transpose(1, 2),  # [b, Hk, L, D]
        v.view(num_seqs, length, num_kv_heads, -1).transpose(1, 2),  # [b, Hk, L, Dv]
        attn_mask=plan.bias,
        scale=scale,
    )  # [b, Hk, G, Dv]
    return out.reshape(num_seqs, num_heads, -1)


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
    starts, lens, q_lens = per_step(
        "layout", (seq_lens, query_start_loc), (), lambda: _layout(seq_lens, query_start_loc)
    )
    decodes = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    is_all = len(decodes) == len(q_lens)  # a decode-only batch: rows 0..B-1 in order
    if decodes and is_all and out is None and starts[-1] == num_tokens:
        # Every row a decode row, none padding: the attention's own output is the result (no
        # [T, H, Dv] allocation and copy).
        return _decode(
            query, key_cache, value_cache, block_tables, seq_lens, lens, decodes, is_all,
            block_size, scale, sliding_window, sinks, soft_cap, k_scale, v_scale,
        ).to(query.dtype)  # fmt: skip
    result = out if out is not None else query.new_empty(num_tokens, num_heads, head_dim_v)
    if starts[-1] < num_tokens:  # padding rows
        result[starts[-1] :].zero_()
    if decodes:
        rows = slice(0, len(decodes)) if is_all else torch.tensor([starts[b] for b in decodes])
        o = _decode(
            query[rows], key_cache, value_cache, block_tables, seq_lens, lens, decodes, is_all,
            block_size, scale, sliding_window, sinks, soft_cap, k_scale, v_scale,
        )  # fmt: skip
        result[rows] = o.to(result.dtype)  # index_put_ (a tensor of rows) does not cast
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
        result[q_start : q_start + q_len] = o  # a slice: copy_, which casts
    return result


def _decode(
    query: torch.Tensor,  # [b, H, D] the decode rows
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lens: list[int],
    decodes: list[int],
    is_all: bool,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    soft_cap: float | None,
    k_scale,
    v_scale,
) -> torch.Tensor:
    """The decode rows' attention [b, H, Dv], fp32."""
    max_seq_len = max(lens[b] for b in decodes)
    flat_k, flat_v = slot_view(key_cache), slot_view(value_cache)
    if sinks is None and soft_cap is None and flat_k is not None and flat_v is not None:
        args = (None if is_all else tuple(decodes), max_seq_len, block_size, sliding_window)
        plan = per_step(
            "decode_plan", (block_tables, seq_lens), args,
            lambda: _decode_plan(block_tables, seq_lens, *args),
        )  # fmt: skip
        return _decode_rows_sdpa(query, flat_k, flat_v, plan, scale, k_scale, v_scale)
    # no SDPA equivalent (sinks, soft cap), or a cache with no slot view
    seqs = slice(None) if is_all else torch.tensor(decodes)
    return _decode_rows(
        query, key_cache, value_cache, block_tables[seqs], seq_lens[seqs], max_seq_len, scale,
        sliding_window, sinks, soft_cap, k_scale, v_scale,
    )  # fmt: skip
