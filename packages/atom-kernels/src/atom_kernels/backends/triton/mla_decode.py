"""MLA decode (one query row per sequence): flash-decoding over the latent cache with several
query heads per program.

``mla_decode_kernel`` grid (cdiv(H, BLOCK_H), B, num_splits) (HEAD_BLOCKS_FIRST; else (B,
cdiv(H, BLOCK_H), num_splits)): one program takes one sequence, BLOCK_H query heads and one split
of that sequence's context. The head blocks of a sequence read the same cache tiles: launched
next to each other they run together and the second read hits L2 (one H200, 128 heads,
2026-12-02, results/mla/s27/mla-grid-ab.json: against the sequences first, 1.0-1.02x at batch
16-64, 1.05 / 1.09x at 256 x 4K / 32K: 1179 against 1241 us, 9127 against 9902 us).

Every head attends over the same cache rows (the latent is one shared kv "head"), so the heads form
the M dim of both dots: logits = q_latent [BLOCK_H, L] @ c^T + q_pe [BLOCK_H, R] @ k_pe^T, and each
latent tile c [BLOCK_N, L] is read once for BLOCK_H heads and is also the value tile (acc [BLOCK_H,
L] += P @ c); the tile loop is the prefill kernel's (mla_prefill.attend_latent_tiles), the page
size a compile-time constant.
Sequences whose query length is not 1 exit at once (the prefill kernel owns them).

Splits follow paged attention's decode (attention_decode): each sequence cuts its context into at
most ``num_splits`` splits of ``max(min_split_len, ceil(seq_len / num_splits))`` tokens. A
sequence with one split finishes its rows in the program; with several, each program writes its
partial (max, sum, acc), and the split that finishes last for its (sequence, head block) merges
them (FUSED_REDUCE: a counter per (sequence, head block), as paged attention's decode). Without
counters ``mla_decode_reduce_kernel`` (grid (B, H, cdiv(L, BLOCK_C))) merges them, one chunk of
the latent dim per program (a whole [splits, 512] fp32 tile would spill).

NOTE (one H200, triton 3.6, 2026-12-01; commit 4a9f0cf, results/mla/s26/mla-transposed-h200.json):
the dots transposed (tokens and latent columns as M: logits^T = c @ q^T, acc^T += c^T @ p^T, so
16-32-head blocks take warpgroup MMAs) were slower than this kernel at 34 of 42 shapes (0.71x at
worst; at most 1.07x faster, batch 1-16). With 64 heads and 8 warps Triton still computes the
logits in both warpgroups either way (m64n32 MMAs over the whole [64, 64] tile a warpgroup).

NOTE (one H200, triton 3.6, 2026-12-02; commit 923e74f, results/mla/s27/mla-exchange-ab.json):
why both warpgroups compute the logits: Triton gives a dot all its warps along M when another
dot is in its forward slice (a "chained dot"); with 64 heads that is 8 warps over 64 rows, each
warpgroup the whole tile. Passing the probabilities and the rescale factors to the value dot
through a per-program global scratch (behind a PTX named barrier, which unlike
tl.debug_barrier leaves the cache loads pipelined) and taking the rope dot first cut the sm_90
SASS to 44 HGMMA a tile from 76, and the exp2s by half, but measured 0.99-1.14x this loop's time
at 128 heads, batch 1-256, 1K-32K (slower from batch 4 x 4K: 352.7 against 309.2 us at 64 x
4K): its 30 barriers a tile against 7 (the cross-warpgroup row max and sum, the scratch, the
layout conversions) cost more than the MMAs saved. So the bound at 128 heads is not the MMA
count but the loop's serialisation (one program an SM, softmax and MMAs in turn). Removed.
"""

import triton
import triton.language as tl

from atom_kernels.backends.triton.attention_common import LOG2E, load_scale
from atom_kernels.backends.triton.attention_decode import _split_len
from atom_kernels.backends.triton.mla_prefill import attend_latent_tiles


# NOTE: split sizes and the block table's width follow the batch's shapes; not specialized on (a
# recompile per value mid-run; see attention_prefill.prefill_kernel).
@triton.jit(do_not_specialize=["min_split_len", "num_splits", "stride_bt"])
def mla_decode_kernel(
    q_latent_ptr,
    q_pe_ptr,
    kv_cache_ptr,
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    count_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_heads,
    latent_dim,
    rope_dim,
    min_split_len,
    num_splits,
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
    SINGLE_SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HEAD_BLOCKS_FIRST: tl.constexpr,
):
    # B = sequences, H = heads, L / R = latent / rope dims; partials [B, H, num_splits(, BLOCK_L)]
    if HEAD_BLOCKS_FIRST:  # grid (head blocks, B, splits): a sequence's head blocks adjacent
        head_block = tl.program_id(0)
        seq = tl.program_id(1)
        head_blocks = tl.num_programs(0)
    else:  # grid (B, head blocks, splits)
        seq = tl.program_id(0)
        head_block = tl.program_id(1)
        head_blocks = tl.num_programs(1)
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

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    q_row64 = q_row.to(tl.int64)
    q = tl.load(
        q_latent_ptr
        + q_row64 * stride_qt
        + heads[:, None] * stride_qh
        + offs_l[None, :] * stride_qd,
        mask=head_mask[:, None] & (offs_l < latent_dim)[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_L]
    q_pe = tl.load(
        q_pe_ptr + q_row64 * stride_pt + heads[:, None] * stride_ph + offs_r[None, :] * stride_pd,
        mask=head_mask[:, None] & (offs_r < rope_dim)[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_scale = load_scale(kv_scale_ptr, kv_scale, KV_SCALE_IS_PTR)  # 1.0 unless fp8
    qk_scale = scale * kv_scale * LOG2E

    m_i = tl.zeros([BLOCK_H], tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    # Whole tiles without a mask (a split's end is tile-aligned unless it is the sequence's end),
    # then at most one masked tile at the end of the sequence.
    full_hi = kv_lo + (kv_hi - kv_lo) // BLOCK_N * BLOCK_N
    q_pos = tl.zeros([BLOCK_H], tl.int32) + seq_len - 1
    acc, l_i, m_i = attend_latent_tiles(
        acc, l_i, m_i, q, q_pe, q_pos, kv_lo, full_hi, kv_cache_ptr, block_table_ptr, seq_len,
        qk_scale, latent_dim, rope_dim, stride_kb, stride_ks, stride_kd, False, PRECISION,
        BLOCK_SIZE, BLOCK_N, BLOCK_L, BLOCK_R,
    )  # fmt: skip
    acc, l_i, m_i = attend_latent_tiles(
        acc, l_i, m_i, q, q_pe, q_pos, full_hi, kv_hi, kv_cache_ptr, block_table_ptr, seq_len,
        qk_scale, latent_dim, rope_dim, stride_kb, stride_ks, stride_kd, True, PRECISION,
        BLOCK_SIZE, BLOCK_N, BLOCK_L, BLOCK_R,
    )  # fmt: skip

    acc = acc * kv_scale  # the values' scale (linear: partials merge unchanged)
    l_mask = head_mask[:, None] & (offs_l < latent_dim)[None, :]
    if SINGLE_SPLIT or seq_len <= split_len:  # one split: finish the rows here
        o_ptrs = out_ptr + q_row64 * stride_ot + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_l[None, :] * stride_od, acc / l_i[:, None], mask=l_mask)
    else:
        first = (seq.to(tl.int64) * num_heads + heads) * num_splits  # [BLOCK_H]
        part = first + split
        tl.store(m_part_ptr + part, m_i, mask=head_mask)
        tl.store(l_part_ptr + part, l_i, mask=head_mask)
        tl.store(acc_part_ptr + part[:, None] * BLOCK_L + offs_l[None, :], acc, mask=l_mask)
        if FUSED_REDUCE:
            tl.debug_barrier()  # every thread's partial stored before the release below
            counter = count_ptr + seq * head_blocks + head_block
            splits = tl.cdiv(seq_len, split_len)
            if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
                m_max = tl.zeros([BLOCK_H], tl.float32) + float("-inf")
                for s in range(splits):  # every split saw a key: m is finite
                    m = tl.load(m_part_ptr + first + s, mask=head_mask, other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                    m_max = tl.maximum(m_max, m)
                denominator = tl.zeros([BLOCK_H], tl.float32)
                acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
                for s in range(splits):
                    weight = tl.exp2(
                        tl.load(m_part_ptr + first + s, mask=head_mask, other=0.0,
                                cache_modifier=".cg") - m_max
                    )  # fmt: skip
                    l_part = tl.load(l_part_ptr + first + s, mask=head_mask, other=0.0,
                                     cache_modifier=".cg")  # fmt: skip
                    denominator += l_part * weight
                    acc += tl.load(
                        acc_part_ptr + (first + s)[:, None] * BLOCK_L + offs_l[None, :],
                        mask=l_mask, other=0.0, cache_modifier=".cg",
                    ) * weight[:, None]  # fmt: skip
                denominator = tl.where(head_mask, denominator, 1.0)
                o_ptrs = out_ptr + q_row64 * stride_ot + heads[:, None] * stride_oh
                tl.store(o_ptrs + offs_l[None, :] * stride_od, acc / denominator[:, None],
                         mask=l_mask)  # fmt: skip
                tl.atomic_xchg(counter, 0)  # ready for the next launch (and graph replay)


@triton.jit(do_not_specialize=["min_split_len", "num_splits"])
def mla_decode_reduce_kernel(
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_heads,
    latent_dim,
    min_split_len,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
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
    weight = tl.exp2(m - m_max)  # every split saw a key: m is finite
    denominator = tl.sum(l_part * weight, 0)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.load(
        acc_part_ptr + part[:, None] * BLOCK_L + offs_c[None, :],
        mask=split_mask[:, None] & (offs_c < BLOCK_L)[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_C]
    out = tl.sum(acc * weight[:, None], 0) / denominator
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_c * stride_od
    tl.store(o_ptrs, out, mask=offs_c < latent_dim)
