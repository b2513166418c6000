"""Varlen (prefill) paged attention: FlashAttention-2 style online softmax over the paged cache.

Grid: one program per (query tile, query head), flattened to 1-D with the heads varying fastest
and the query tiles in reverse order, so the heaviest causal tiles (the last rows of a sequence,
which see the most keys) start first and the light ones fill the tail of the last wave. Query
tiles are numbered without a host sync: sequence b owns tiles ``qsl[b] // BLOCK_M + b ...`` (an
upper bound on the tiles its rows need), found by a binary search over query_start_loc; spare
tiles exit at once. Tiles past the last sequence zero the padding rows ``qsl[B]:T``. Sequences with
one query row are left to the decode kernel.

Each program walks the KV tiles its rows can see, gathered through the block table (the page size
is a compile-time constant, so page and offset are a shift and a mask): tiles before the window or
after the causal diagonal are never visited, tiles that every row sees whole run without any mask,
the edge tiles with the causal / window / length mask. Logits stay unscaled; the softmax scale
(times log2 e) is applied inside the exp2 argument as one FMA, and the row maximum is kept in the
scaled log2 domain (the scale is positive, so the maximum commutes with it).
"""

import triton
import triton.language as tl

from atom_kernels.backends.triton.attention_common import LOG2E, find_seq, load_scale
from atom_kernels.backends.triton.jit_utils import tanh


@triton.jit
def _pages(block_table_ptr, start, end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical block of each token of the KV tile ``start + arange(BLOCK_N)`` (start a multiple
    of BLOCK_N), int64 [BLOCK_N]; table entries of pages at or past ``end`` (the sequence
    length: every token the K/V loads do not mask has its real page) are not read (0).

    When pages tile the KV tile (BLOCK_SIZE divides BLOCK_N, at most 8 pages, or BLOCK_N divides
    BLOCK_SIZE) the table is read one scalar per page, otherwise one entry per token.
    """
    if BLOCK_N % BLOCK_SIZE == 0 and BLOCK_N // BLOCK_SIZE <= 8:
        first_page = start // BLOCK_SIZE
        page_of_token = tl.arange(0, BLOCK_N) // BLOCK_SIZE
        block = tl.zeros([BLOCK_N], tl.int64)
        for j in tl.static_range(BLOCK_N // BLOCK_SIZE):
            mask = start + j * BLOCK_SIZE < end
            page = tl.load(block_table_ptr + first_page + j, mask=mask, other=0)
            block = tl.where(page_of_token == j, page.to(tl.int64), block)
    elif BLOCK_SIZE % BLOCK_N == 0:  # the whole tile sits in one page
        page = tl.load(block_table_ptr + start // BLOCK_SIZE, mask=start < end, other=0)
        block = tl.zeros([BLOCK_N], tl.int64) + page.to(tl.int64)
    else:  # pages straddle tiles
        tokens = start + tl.arange(0, BLOCK_N)
        page = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=tokens < end, other=0)
        block = page.to(tl.int64)
    return block


@triton.jit
def _gather_kv(
    k_cache_ptr,
    v_cache_ptr,
    block,
    tokens,
    seq_len,
    kv_head,
    head_dim,
    head_dim_v,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    compute_dtype: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """K [BLOCK_N, BLOCK_D] and V [BLOCK_N, BLOCK_DV] of ``tokens`` (positions in the sequence)
    in the physical blocks ``block`` (see _pages). MASKED: tokens past ``seq_len`` read as 0;
    otherwise every token is in the sequence and the loads carry no token mask. EVEN_D: the
    head dims are their block sizes (no dim mask). fp8 entries are converted exactly; their
    scales are applied by the caller."""
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    offset = tokens % BLOCK_SIZE
    k_rows = block * stride_kb + offset * stride_ks + kv_head * stride_kh
    v_rows = block * stride_vb + offset * stride_vs + kv_head * stride_vh
    k_ptrs = k_cache_ptr + k_rows[:, None] + d[None, :] * stride_kd
    v_ptrs = v_cache_ptr + v_rows[:, None] + dv[None, :] * stride_vd
    if MASKED:
        token_mask = tokens < seq_len
        if EVEN_D:
            k = tl.load(k_ptrs, mask=token_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=token_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=token_mask[:, None] & (d < head_dim)[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=token_mask[:, None] & (dv < head_dim_v)[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=(d < head_dim)[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=(dv < head_dim_v)[None, :], other=0.0)
    return k.to(compute_dtype), v.to(compute_dtype)


@triton.jit
def _prefill_tile(
    acc,
    l_i,
    m_i,
    block,
    start,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    seq_len,
    window,
    qk_scale,
    log2_scale,
    softcap,
    head_dim,
    head_dim_v,
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
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One online-softmax step over the KV tile at ``start`` whose pages are ``block``; returns
    the new (acc, l_i, m_i) and the pages of the next tile."""
    tokens = start + tl.arange(0, BLOCK_N)
    k, v = _gather_kv(
        k_cache_ptr, v_cache_ptr, block, tokens, seq_len, kv_head, head_dim, head_dim_v,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
        stride_vd, q.dtype, MASKED, EVEN_D, BLOCK_SIZE, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    block = _pages(block_table_ptr, start + BLOCK_N, seq_len, BLOCK_SIZE, BLOCK_N)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [M, N]
    if HAS_SOFTCAP:
        s = (softcap * LOG2E) * tanh(s * (qk_scale / softcap))
    if MASKED:
        # Valid rows sit below seq_len, so the causal test also drops the tokens past it.
        visible = tokens[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - tokens[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * log2_scale)
        # A row with no visible key so far keeps m = -inf; exp2(-inf - 0) adds nothing.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:  # every row sees every key of the tile: the maximum is finite
        m_new = tl.maximum(m_i, tl.max(s, 1) * log2_scale)
        m_safe = m_new
    p = tl.exp2(s * log2_scale - m_safe[:, None])  # one FMA and one exp2 per logit
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    # The rescale comes after the logits so the previous tile's PV product can still run.
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new, block


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
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Online softmax over the KV tiles [tile_lo, tile_hi) (multiples of BLOCK_N). acc is
    unnormalised (divided by l_i once, at the end); m_i is the running row maximum of the scaled
    log2-domain logits. WARP_SPECIALIZE: the loop is a ``tl.range(warp_specialize=True)`` (only
    set by the launcher where this Triton has it; the other branch never sees the keyword)."""
    # Logit -> log2-domain factor. With a soft-cap the transform is not linear: the capped
    # logits are computed in the log2 domain and the factor is 1.
    if HAS_SOFTCAP:
        log2_scale = 1.0
    else:
        log2_scale = qk_scale * LOG2E
    # NOTE: the page ids are read one tile ahead and carried. Read in the tile that uses them,
    # the software pipeliner turns the table load into an async copy one indirection level
    # before the K/V copies, which then go one tile ahead only and are waited for at once (sm_90
    # TTGIR, triton 3.9, 128x64 tiles, 3 or 4 stages: two K/V buffers, async_wait num=0 at the
    # loop top). Carried, the table loads stay plain loads and the K/V copies run
    # num_stages - 1 tiles ahead (three buffers, async_wait num=2 at 3 stages).
    block = _pages(block_table_ptr, tile_lo, seq_len, BLOCK_SIZE, BLOCK_N)
    if WARP_SPECIALIZE:
        for start in tl.range(tile_lo, tile_hi, BLOCK_N, warp_specialize=True):
            acc, l_i, m_i, block = _prefill_tile(
                acc, l_i, m_i, block, start, q, q_pos, k_cache_ptr, v_cache_ptr,
                block_table_ptr, kv_head, seq_len, window, qk_scale, log2_scale, softcap,
                head_dim, head_dim_v, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
                stride_vs, stride_vh, stride_vd, MASKED, HAS_WINDOW, HAS_SOFTCAP, EVEN_D,
                PRECISION, BLOCK_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV,
            )  # fmt: skip
    else:
        for start in range(tile_lo, tile_hi, BLOCK_N):
            acc, l_i, m_i, block = _prefill_tile(
                acc, l_i, m_i, block, start, q, q_pos, k_cache_ptr, v_cache_ptr,
                block_table_ptr, kv_head, seq_len, window, qk_scale, log2_scale, softcap,
                head_dim, head_dim_v, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
                stride_vs, stride_vh, stride_vd, MASKED, HAS_WINDOW, HAS_SOFTCAP, EVEN_D,
                PRECISION, BLOCK_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV,
            )  # fmt: skip
    return acc, l_i, m_i


# NOTE: counts and the block table's width change from step to step; specializing on them (Triton
# compiles a variant per "== 1" / "% 16 == 0" of an int argument) recompiled the kernel in the
# middle of a run (seconds of a step, measured on the H100 throughput benchmark).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"])
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
    num_heads,
    num_queries_per_kv,
    head_dim,
    head_dim_v,
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
    EVEN_D: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # T = query tokens, B = sequences, H = query heads; q [T, H, D],
    # caches [blocks, BLOCK_SIZE, Hk, D | Dv]; grid (num_tiles * H,)
    pid = tl.program_id(0)
    head = pid % num_heads
    tile = pid // num_heads
    if HEAVY_FIRST:
        tile = num_tokens // BLOCK_M + num_seqs - tile  # num_tiles - 1 - tile
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
    # NOTE: the scale must be positive (the row maximum is taken before scaling).
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
    full_lo = 0
    if HAS_WINDOW:  # masked tiles where the window starts: [kv_lo, full_lo)
        kv_lo = (tl.maximum(pos_lo - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(pos_hi - window + 1, 0), BLOCK_N) * BLOCK_N
        if full_lo >= full_hi:  # no whole tile: everything goes through this masked loop
            full_lo = kv_hi
            full_hi = kv_hi
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, q_pos, kv_lo, full_lo, k_cache_ptr, v_cache_ptr, block_table_ptr,
            kv_head, seq_len, window, qk_scale, softcap, head_dim, head_dim_v, stride_kb,
            stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, True,
            HAS_WINDOW, HAS_SOFTCAP, EVEN_D, PRECISION, False, BLOCK_SIZE, BLOCK_N, BLOCK_D,
            BLOCK_DV,
        )  # fmt: skip
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, full_lo, full_hi, k_cache_ptr, v_cache_ptr, block_table_ptr,
        kv_head, seq_len, window, qk_scale, softcap, head_dim, head_dim_v, stride_kb,
        stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, False,
        HAS_WINDOW, HAS_SOFTCAP, EVEN_D, PRECISION, WARP_SPECIALIZE, BLOCK_SIZE, BLOCK_N,
        BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, full_hi, kv_hi, k_cache_ptr, v_cache_ptr, block_table_ptr,
        kv_head, seq_len, window, qk_scale, softcap, head_dim, head_dim_v, stride_kb,
        stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, True,
        HAS_WINDOW, HAS_SOFTCAP, EVEN_D, PRECISION, False, BLOCK_SIZE, BLOCK_N, BLOCK_D,
        BLOCK_DV,
    )  # fmt: skip

    v_scale = load_scale(v_scale_ptr, v_scale, V_SCALE_IS_PTR)
    l_i = tl.where(row_mask, l_i, 1.0)  # rows past the query: no key, never stored
    out = acc * (v_scale / l_i)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out, mask=row_mask[:, None] & (offs_dv < head_dim_v)[None, :])
