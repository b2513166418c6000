"""Varlen (prefill) paged attention: FlashAttention-2 style online softmax over the paged cache.

Grid (query tiles, query heads). Query tiles are numbered without a host sync: sequence b owns
tiles ``qsl[b] // BLOCK_M + b ...`` (an upper bound on the tiles its rows need), found by a binary
search over query_start_loc; spare tiles exit at once. Tiles past the last sequence zero the padding
rows ``qsl[B]:T``. Sequences with one query row are left to the decode kernel.

Each program walks the KV tiles its rows can see, gathered token by token through the block table:
tiles before the window or after the causal diagonal are never visited, tiles that every row sees
whole run without a mask, the edge tiles with the causal / window / length mask.
"""

import triton
import triton.language as tl

from atom_kernels.backends.triton.attention_common import (
    LOG2E,
    find_seq,
    gather_kv,
    load_scale,
    scores,
    softmax_step,
)


@triton.jit
def _prefill_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    tile_lo,
    tile_hi,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    seq_len,
    window,
    qk_scale,
    softcap,
    head_dim,
    head_dim_v,
    block_size,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(tile_lo, tile_hi, BLOCK_N):
        tokens = start + offs_n
        if MASKED:
            token_mask = tokens < seq_len
        else:  # every token of the tile is in the sequence and seen by every row
            token_mask = offs_n < BLOCK_N
        k, v = gather_kv(
            k_cache_ptr, v_cache_ptr, block_table_ptr, tokens, token_mask, kv_head, head_dim,
            head_dim_v, block_size, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
            stride_vs, stride_vh, stride_vd, q.dtype, BLOCK_D, BLOCK_DV,
        )  # fmt: skip
        s = scores(q, k, qk_scale, softcap, HAS_SOFTCAP, PRECISION)
        if MASKED:
            visible = (tokens[None, :] <= q_pos[:, None]) & token_mask[None, :]
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - tokens[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, s, v, PRECISION)
    return acc, l_i, m_i


@triton.jit
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_seqs,
    num_tokens,
    num_queries_per_kv,
    head_dim,
    head_dim_v,
    block_size,
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
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    K_SCALE_IS_PTR: tl.constexpr,
    V_SCALE_IS_PTR: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # T = query tokens, B = sequences; q [T, H, D], caches [blocks, block_size, Hk, D | Dv]
    tile = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    num_rows = tl.load(query_start_loc_ptr + num_seqs).to(tl.int32)
    tail_tile = num_rows // BLOCK_M + num_seqs
    if tile >= tail_tile:  # zero the padding rows qsl[B]:T of this head
        rows = (num_rows + (tile - tail_tile) * BLOCK_M + offs_m).to(tl.int64)
        mask = (rows < num_tokens)[:, None] & (offs_dv < head_dim_v)[None, :]
        ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :] * stride_od
        tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_DV], tl.float32), mask=mask)
        return
    seq = find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    first_row = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    if q_len <= 1 or first_row >= q_len:  # decode rows (other kernel) or a spare tile
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len  # position of the sequence's first query row
    rows = first_row + offs_m
    row_mask = rows < q_len
    q_pos = context_len + rows  # [BLOCK_M]
    q_rows = (q_start + rows).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_mask[:, None] & (offs_d < head_dim)[None, :], other=0.0)

    kv_head = head // num_queries_per_kv
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    qk_scale = scale * load_scale(k_scale_ptr, k_scale, K_SCALE_IS_PTR)
    if HAS_SINKS:  # the sink is one more logit in the denominator, with no value
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Keys seen by some row: [kv_lo, kv_hi); by every row: [full_lo, full_hi) (tile-aligned).
    pos_lo = context_len + first_row
    pos_hi = context_len + tl.minimum(q_len, first_row + BLOCK_M) - 1
    kv_hi = pos_hi + 1
    full_hi = ((pos_lo + 1) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        kv_lo = (tl.maximum(pos_lo - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(pos_hi - window + 1, 0), BLOCK_N) * BLOCK_N
    else:
        kv_lo = 0
        full_lo = 0
    if full_lo >= full_hi:  # no whole tile: everything goes through the masked loop
        full_lo = kv_hi
        full_hi = kv_hi
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, kv_lo, full_lo, k_cache_ptr, v_cache_ptr, block_table_ptr,
        kv_head, seq_len, window, qk_scale, softcap, head_dim, head_dim_v, block_size,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        True, HAS_WINDOW, HAS_SOFTCAP, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, full_lo, full_hi, k_cache_ptr, v_cache_ptr, block_table_ptr,
        kv_head, seq_len, window, qk_scale, softcap, head_dim, head_dim_v, block_size,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        False, HAS_WINDOW, HAS_SOFTCAP, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, full_hi, kv_hi, k_cache_ptr, v_cache_ptr, block_table_ptr,
        kv_head, seq_len, window, qk_scale, softcap, head_dim, head_dim_v, block_size,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        True, HAS_WINDOW, HAS_SOFTCAP, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip

    v_scale = load_scale(v_scale_ptr, v_scale, V_SCALE_IS_PTR)
    l_i = tl.where(row_mask, l_i, 1.0)  # rows past the query: no key, never stored
    out = acc * (v_scale / l_i)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out, mask=row_mask[:, None] & (offs_dv < head_dim_v)[None, :])
