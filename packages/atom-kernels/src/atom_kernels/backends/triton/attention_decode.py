"""Decode paged attention (one query row per sequence): flash-decoding with GQA packing.

``decode_kernel`` grid (B, Hk, num_splits): one program takes one sequence, one kv head and one
split of that sequence's context, and all the query heads of that kv head's group at once (the
group's q rows form the M dim of the dot, padded to >= 16), so each K/V tile is read once per
group. Sequences whose query length is not 1 exit at once (the prefill kernel owns them).

Each sequence cuts its own context into at most ``num_splits`` splits of
``split_len(seq_len) = max(min_split_len, ceil(seq_len / num_splits))`` tokens (rounded up to the
KV tile), so long and short contexts in one batch give programs of similar work. A sequence with
one split finishes its row in the program (sinks included); with several, each program writes its
partial (max, sum, acc), and the split that finishes last for its (sequence, kv head) merges the
group's partials and adds the sink (FUSED_REDUCE: a counter per (sequence, kv head), counted with
release / acquire atomics and set back to zero by the merging program; no second kernel). Without
counters (``FUSED_REDUCE`` off) ``decode_reduce_kernel`` (grid (B, H)) merges them.
"""

import triton
import triton.language as tl

from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.attention_common import (
    LOG2E,
    gather_kv,
    load_scale,
    scores,
    softmax_step,
)


@triton.jit
def _split_len(seq_len, min_split_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split of a sequence (see the module docstring); min_split_len is a multiple of
    BLOCK_N."""
    even = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(even, min_split_len)


# NOTE: split sizes and the block table's width follow the batch's shapes; not specialized on (see
# prefill_kernel).
@triton.jit(do_not_specialize=["min_split_len", "num_splits", "stride_bt"])
def decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    count_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_heads,
    num_queries_per_kv,
    head_dim,
    head_dim_v,
    block_size,
    min_split_len,
    num_splits,
    scale,
    k_scale,
    v_scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    SINGLE_SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    K_SCALE_IS_PTR: tl.constexpr,
    V_SCALE_IS_PTR: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    PAGE_SIZE: tl.constexpr = 0,  # block_size as a constant (a power of two); 0: read at runtime
):
    # B = sequences, G = query heads per kv head; partials [B, H, num_splits(, BLOCK_DV)] fp32
    if USE_PDL:  # launched early behind the previous kernel (pdl.py): nothing read before this
        pdl.wait_for_previous()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    split_len = _split_len(seq_len, min_split_len, num_splits, BLOCK_N)
    kv_lo = split * split_len
    if kv_lo >= seq_len:  # past the end of this sequence: the reduce skips this split
        return
    kv_hi = tl.minimum(kv_lo + split_len, seq_len)
    if HAS_WINDOW:  # the row at position seq_len - 1 sees keys > seq_len - 1 - window
        kv_lo = tl.maximum(kv_lo, seq_len - window)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * num_queries_per_kv + g
    head_mask = g < num_queries_per_kv
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q = tl.load(
        q_ptrs + offs_d[None, :] * stride_qd,
        mask=head_mask[:, None] & (offs_d < head_dim)[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    qk_scale = scale * load_scale(k_scale_ptr, k_scale, K_SCALE_IS_PTR)

    m_i = tl.zeros([BLOCK_G], tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        tokens = start + offs_n
        token_mask = tokens < kv_hi
        k, v = gather_kv(
            k_cache_ptr, v_cache_ptr, block_table_ptr, tokens, token_mask, kv_head, head_dim,
            head_dim_v, block_size, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
            stride_vs, stride_vh, stride_vd, q.dtype, BLOCK_D, BLOCK_DV, PAGE_SIZE,
        )  # fmt: skip
        s = scores(q, k, qk_scale, softcap, HAS_SOFTCAP, PRECISION)
        s = tl.where(token_mask[None, :], s, float("-inf"))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, s, v, PRECISION)
    acc = acc * load_scale(v_scale_ptr, v_scale, V_SCALE_IS_PTR)

    dv_mask = head_mask[:, None] & (offs_dv < head_dim_v)[None, :]
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    o_ptrs += offs_dv[None, :] * stride_od
    if SINGLE_SPLIT or seq_len <= split_len:  # one split: finish the row here
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * LOG2E
            m_new = tl.maximum(m_i, sink)
            l_i = l_i * tl.exp2(m_i - m_new) + tl.exp2(sink - m_new)
            acc = acc * tl.exp2(m_i - m_new)[:, None]
        tl.store(o_ptrs, acc / l_i[:, None], mask=dv_mask)
    else:
        first = (seq.to(tl.int64) * num_heads + heads) * num_splits  # [BLOCK_G]
        part = first + split
        tl.store(m_part_ptr + part, m_i, mask=head_mask)
        tl.store(l_part_ptr + part, l_i, mask=head_mask)
        tl.store(acc_part_ptr + part[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=dv_mask)
        if FUSED_REDUCE:
            tl.debug_barrier()  # every thread's partial stored before the release below
            counter = count_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == tl.cdiv(seq_len, split_len) - 1:
                _merge_splits(
                    o_ptrs, m_part_ptr, l_part_ptr, acc_part_ptr, sinks_ptr, first, heads,
                    head_mask, dv_mask, tl.cdiv(seq_len, split_len), HAS_SINKS, BLOCK_G,
                    BLOCK_DV,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0)  # ready for the next launch (and graph replay)


@triton.jit
def _merge_splits(
    o_ptrs, m_part_ptr, l_part_ptr, acc_part_ptr, sinks_ptr, first, heads, head_mask, dv_mask,
    splits, HAS_SINKS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """The group's rows from its ``splits`` partials (first split at ``first`` [BLOCK_G]), as
    ``decode_reduce_kernel`` merges them, read through L2 (written by other programs)."""
    m_max = tl.zeros([BLOCK_G], tl.float32) + float("-inf")
    for s in range(splits):
        m = tl.load(m_part_ptr + first + s, mask=head_mask, other=0.0, cache_modifier=".cg")
        m_max = tl.maximum(m_max, m)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(head_mask, m_max, 0.0)
    denominator = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    offs_dv = tl.arange(0, BLOCK_DV)
    for s in range(splits):
        # Splits that saw no key (outside the window) have m = -inf and weigh 0.
        m = tl.load(m_part_ptr + first + s, mask=head_mask, other=float("-inf"),
                    cache_modifier=".cg")  # fmt: skip
        weight = tl.exp2(m - m_max)
        l_part = tl.load(l_part_ptr + first + s, mask=head_mask, other=0.0, cache_modifier=".cg")
        denominator += l_part * weight
        part_acc = tl.load(
            acc_part_ptr + (first + s)[:, None] * BLOCK_DV + offs_dv[None, :],
            mask=dv_mask, other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        acc += part_acc * weight[:, None]
    if HAS_SINKS:
        denominator += tl.exp2(sink - m_max)
    denominator = tl.where(head_mask, denominator, 1.0)
    tl.store(o_ptrs, acc / denominator[:, None], mask=dv_mask)


@triton.jit(do_not_specialize=["min_split_len", "num_splits"])
def decode_reduce_kernel(
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    num_heads,
    head_dim_v,
    min_split_len,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HAS_SINKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # as in decode_kernel
        pdl.wait_for_previous()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    split_len = _split_len(seq_len, min_split_len, num_splits, BLOCK_N)
    if seq_len <= split_len:  # one split: the decode kernel finished the row
        return
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < tl.cdiv(seq_len, split_len)
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
    m = tl.load(m_part_ptr + part, mask=split_mask, other=float("-inf"))
    l_part = tl.load(l_part_ptr + part, mask=split_mask, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    # Splits that saw no key (outside the window) have m = -inf and weigh 0.
    weight = tl.exp2(m - m_max)
    denominator = tl.sum(l_part * weight, 0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - m_max)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.load(
        acc_part_ptr + part[:, None] * BLOCK_DV + offs_dv[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )  # [BLOCK_S, BLOCK_DV]
    out = tl.sum(acc * weight[:, None], 0) / denominator
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_dv * stride_od
    tl.store(o_ptrs, out, mask=offs_dv < head_dim_v)
