"""MLA prefill with a cached prefix: the query rows of each sequence (more than one) against its
paged latent cache, causal, FlashAttention-2 style online softmax.

Every head reads the same cache rows, so a program takes BLOCK_M (query row, head) pairs of one
sequence: the sequence's q_len * H pairs are numbered row-major (pair p = row p // H, head p % H)
and cut into tiles of BLOCK_M. With H = 16 a tile holds whole rows of heads; with H = 128 it holds
part of one row's heads; odd head counts waste no padded heads. Each latent tile c [BLOCK_N, L]
read from the cache serves every pair of the tile, as key (with k_pe) and as value.

Grid: 1-D, tiles in reverse order (the heaviest causal tiles, at the end of a sequence, start
first). Tiles are numbered without a host sync: sequence b owns tiles
``qsl[b] * H // BLOCK_M + b ...`` (an upper bound on its cdiv(q_len_b * H, BLOCK_M) tiles), found by
a binary search over query_start_loc; spare tiles exit at once. Tiles past the last sequence zero
the padding rows qsl[B]:T. Sequences with one query row are left to the decode kernel.

KV tiles every pair of the tile sees whole run without a mask; the tiles across the causal
diagonal of the tile's rows run with it.
"""

import triton
import triton.language as tl

from atom_kernels.backends.triton.attention_common import LOG2E, load_scale, softmax_step
from atom_kernels.backends.triton.attention_prefill import _pages


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, num_heads, BLOCK_M: tl.constexpr):
    """The sequence owning tile ``tile`` (see the module docstring)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) * num_heads // BLOCK_M + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def attend_latent_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pe,
    q_pos,
    tile_lo,
    tile_hi,
    kv_cache_ptr,
    block_table_ptr,
    seq_len,
    qk_scale,
    latent_dim,
    rope_dim,
    stride_kb,
    stride_ks,
    stride_kd,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Online softmax of q / q_pe [M, *] over the latent cache's KV tiles [tile_lo, tile_hi)
    (tile_lo a multiple of BLOCK_N), c serving as key (with k_pe) and value. MASKED: the causal
    mask (q_pos [M], each row's position) and tokens past seq_len read as 0; otherwise every row
    sees every token of the tiles. fp8 entries are converted (exactly) to q's dtype; their scale
    is applied by the caller (in qk_scale and on the output). Shared with the decode kernel."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_mask = (offs_l < latent_dim)[None, :]
    r_mask = (offs_r < rope_dim)[None, :]
    for start in range(tile_lo, tile_hi, BLOCK_N):
        tokens = start + offs_n
        block = _pages(block_table_ptr, start, seq_len, BLOCK_SIZE, BLOCK_N)
        rows = block * stride_kb + (tokens % BLOCK_SIZE).to(tl.int64) * stride_ks
        c_ptrs = kv_cache_ptr + rows[:, None] + offs_l[None, :] * stride_kd
        pe_ptrs = kv_cache_ptr + rows[:, None] + (latent_dim + offs_r)[None, :] * stride_kd
        if MASKED:
            token_mask = (tokens < seq_len)[:, None]
            c = tl.load(c_ptrs, mask=token_mask & l_mask, other=0.0)
            k_pe = tl.load(pe_ptrs, mask=token_mask & r_mask, other=0.0)
        else:
            c = tl.load(c_ptrs, mask=l_mask, other=0.0)
            k_pe = tl.load(pe_ptrs, mask=r_mask, other=0.0)
        c = c.to(q.dtype)
        k_pe = k_pe.to(q.dtype)
        s = tl.dot(q, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        s = s * qk_scale
        if MASKED:
            # Valid pairs sit below seq_len, so the causal test also drops the tokens past it.
            s = tl.where(tokens[None, :] <= q_pos[:, None], s, float("-inf"))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, s, c, PRECISION)
    return acc, l_i, m_i


# NOTE: counts and the block table's width change from step to step: not specialized on (see
# attention_prefill.prefill_kernel).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"])
def mla_prefill_kernel(
    q_latent_ptr,
    q_pe_ptr,
    kv_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_tokens,
    num_heads,
    latent_dim,
    rope_dim,
    scale,
    kv_scale_ptr,
    kv_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_pt,
    stride_ph,
    stride_pd,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    KV_SCALE_IS_PTR: tl.constexpr,
    PRECISION: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # T = query tokens, B = sequences, H = heads; q_latent [T, H, L], q_pe [T, H, R],
    # kv_cache [blocks, BLOCK_SIZE, L + R], out [T, H, L]; grid (num_tiles,)
    tile = tl.program_id(0)
    if HEAVY_FIRST:
        tile = num_tokens * num_heads // BLOCK_M + num_seqs - tile  # num_tiles - 1 - tile
    offs_m = tl.arange(0, BLOCK_M)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_mask = (offs_l < latent_dim)[None, :]
    num_rows = tl.load(query_start_loc_ptr + num_seqs).to(tl.int32)
    tail_tile = num_rows * num_heads // BLOCK_M + num_seqs
    if tile >= tail_tile:  # zero the padding rows qsl[B]:T, all heads
        pairs = (num_rows * num_heads + (tile - tail_tile) * BLOCK_M + offs_m).to(tl.int64)
        rows, heads = pairs // num_heads, pairs % num_heads
        ptrs = (
            out_ptr + (rows * stride_ot + heads * stride_oh)[:, None] + offs_l[None, :] * stride_od
        )
        mask = (rows < num_tokens)[:, None] & l_mask
        tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_L], tl.float32), mask=mask)
        return
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, num_heads, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    first_pair = (tile - (q_start * num_heads // BLOCK_M + seq)) * BLOCK_M
    num_pairs = q_len * num_heads
    if q_len <= 1 or first_pair >= num_pairs:  # decode rows (other kernel) or a spare tile
        return
    pairs = first_pair + offs_m
    pair_mask = pairs < num_pairs
    rows, heads = pairs // num_heads, pairs % num_heads
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len  # position of the sequence's first query row
    q_pos = context_len + rows  # [BLOCK_M]
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_latent_ptr
        + (q_rows * stride_qt + heads * stride_qh)[:, None]
        + offs_l[None, :] * stride_qd,
        mask=pair_mask[:, None] & l_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_L]
    q_pe = tl.load(
        q_pe_ptr + (q_rows * stride_pt + heads * stride_ph)[:, None] + offs_r[None, :] * stride_pd,
        mask=pair_mask[:, None] & (offs_r < rope_dim)[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_R]
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_scale = load_scale(kv_scale_ptr, kv_scale, KV_SCALE_IS_PTR)  # 1.0 unless fp8
    qk_scale = scale * kv_scale * LOG2E

    m_i = tl.zeros([BLOCK_M], tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    # Keys seen by some pair: [0, kv_hi); by every pair: [0, full_hi) (tile-aligned).
    pos_lo = context_len + first_pair // num_heads
    pos_hi = context_len + (tl.minimum(num_pairs, first_pair + BLOCK_M) - 1) // num_heads
    kv_hi = pos_hi + 1
    full_hi = ((pos_lo + 1) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = attend_latent_tiles(
        acc, l_i, m_i, q, q_pe, q_pos, 0, full_hi, kv_cache_ptr, block_table_ptr, seq_len,
        qk_scale, latent_dim, rope_dim, stride_kb, stride_ks, stride_kd, False, PRECISION,
        BLOCK_SIZE, BLOCK_N, BLOCK_L, BLOCK_R,
    )  # fmt: skip
    acc, l_i, m_i = attend_latent_tiles(
        acc, l_i, m_i, q, q_pe, q_pos, full_hi, kv_hi, kv_cache_ptr, block_table_ptr, seq_len,
        qk_scale, latent_dim, rope_dim, stride_kb, stride_ks, stride_kd, True, PRECISION,
        BLOCK_SIZE, BLOCK_N, BLOCK_L, BLOCK_R,
    )  # fmt: skip

    l_i = tl.where(pair_mask, l_i, 1.0)  # pairs past the query: never stored
    o_ptrs = (
        out_ptr + (q_rows * stride_ot + heads * stride_oh)[:, None] + offs_l[None, :] * stride_od
    )
    tl.store(o_ptrs, acc * (kv_scale / l_i)[:, None], mask=pair_mask[:, None] & l_mask)
