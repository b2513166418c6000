"""Triton MLA attention launcher: picks tile sizes and the decode split, launches the kernels.

Routing is per sequence, on the device, as in paged attention (attention.py): the prefill kernel
(mla_prefill) takes the sequences with more than one query row and zeroes the padding rows; the
decode kernel (mla_decode) takes the sequences with exactly one. Both are launched for every batch,
sized from shapes alone (no host sync, CUDA-graph safe), except that a decode-only batch known
from the ``max_query_len`` hint skips the prefill launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from atom_kernels.backends.triton.attention import MAX_SPLITS, fuse_decode_reduce
from atom_kernels.backends.triton.common import (
    is_interpreted,
    next_pow2,
    num_sms,
    scale_args,
    zeroed_counters,
)
from atom_kernels.backends.triton.mla_decode import mla_decode_kernel, mla_decode_reduce_kernel
from atom_kernels.backends.triton.mla_prefill import mla_prefill_kernel

# Latent columns per program of the split reduce: [MAX_SPLITS, 64] fp32 partials a program.
REDUCE_BLOCK_C = 64
# Decode programs a launch aims for, an SM: a program of 64 heads of L = 512 takes 221 KB of
# shared memory (one an SM), smaller head blocks fit two (see choose_splits).
PROGRAMS_PER_SM_WIDE = 1
PROGRAMS_PER_SM = 2
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dim


@dataclass(frozen=True)
class MlaConfig:
    """Tiles and launch options of the MLA kernels: prefill tiles of ``prefill_block_m`` (row,
    head) pairs x ``prefill_block_n`` cache tokens; decode programs of ``decode_block_h`` heads x
    ``decode_block_n`` tokens."""

    prefill_block_m: int
    prefill_block_n: int
    prefill_num_warps: int
    prefill_num_stages: int
    decode_block_h: int
    decode_block_n: int
    decode_num_warps: int
    decode_num_stages: int
    prefill_heavy_first: bool = True
    # mla_decode's HEAD_BLOCKS_FIRST: a sequence's head blocks launched side by side.
    decode_head_blocks_first: bool = True


def default_config(
    latent_dim: int, dtype: torch.dtype, interpreted: bool, num_heads: int = 16
) -> MlaConfig:
    """Tiles for a latent dim (padded to a power of two), the query dtype and the head count.

    NOTE (one H100, triton 3.6, torch 2.11, bf16, L = 512, R = 64, page 16, do_bench medians,
    2026-11-23; a sweep script outside the repo): prefill, 128 heads: 64 x 64 tiles / 8 warps /
    2 stages 290 TFLOP/s (causal 4096 tokens 8.02 ms, 2048 over a 6144 prefix 13.8 ms; 70
    spilled registers), 32 x 64 / 4 warps / 3 stages 240, 64 x 32 / 8 warps 199, 32 x 32 /
    8 warps 101; 128-row tiles spill 400-550 registers (36-75 TFLOP/s); 32 x 128 needs more
    shared memory than the H100 has. Decode, 128 heads in 64-head blocks, 64-token tiles / 8
    warps / 2 stages: 64 x 4096 tokens 324 us (226 TFLOP/s), 256 x 1024 364 us, 8 x 4096 81 us;
    32-token tiles 436 / 463 / 93 us; with the first kernel (every tile masked) 16-head blocks
    of 4 warps took 953 us at 64 x 4096 against 425 us for 64-head ones (a latent tile serves
    more heads). Decode, 16 heads (128 over TP 8), one
    16-head block / 4 warps: 64-token tiles 64 x 4096 169 us (1.79 TB/s of cache), 256 x 1024
    118 us (2.57 TB/s); 32-token tiles 237 / 132 us, 16-token 253 / 173 us. 32 heads (TP 4),
    one 32-head block, 64-token tiles: 4 warps 8 x 4096 96 us, 64 x 4096 211 us, 256 x 1024
    132 us; 8 warps 136 / 218 / 175 us. Tile sizes for L <= 128 and fp32 (tests) are not
    measured.
    """
    if interpreted:  # small tiles: several KV tiles and tiles of pairs even at test sizes
        return MlaConfig(16, 16, 4, 1, 16, 16, 4, 1)
    block_l = next_pow2(latent_dim, 16)
    if dtype == torch.float32:
        return MlaConfig(16, 16, 4, 2, 16, 16, 4, 2)
    block_h = min(next_pow2(num_heads, 16), 64)
    if block_l <= 128:
        return MlaConfig(64, 64, 4, 2, block_h, 64, 4, 2)
    return MlaConfig(64, 64, 8, 2, block_h, 64, 8 if block_h >= 64 else 4, 2)


def choose_splits(
    num_seqs: int, head_blocks: int, max_context: int, num_sms: int, block_n: int, block_h: int
) -> tuple[int, int]:
    """(num_splits, min_split_len) of the decode grid (head_blocks, num_seqs, num_splits).

    Splits cut each sequence until the grid holds about PROGRAMS_PER_SM programs an SM
    (PROGRAMS_PER_SM_WIDE for 64-head blocks): num_splits = programs wanted // (num_seqs x
    head_blocks), at most MAX_SPLITS and the table's tiles, splits of at least one tile. A
    sequence of seq_len tokens takes max(block_n, seq_len / num_splits) tokens a split
    (attention_decode._split_len). ``max_context`` is what the block table can hold (shapes only:
    no host sync).

    NOTE (one H200, triton 3.6, torch 2.11, bf16, L = 512, R = 64, page 16, cold-L2 CUDA graphs,
    2026-12-01; benchmarks/mla_splits.py, results/mla/s26/mla-splits-h200.json): at 128, 32 and
    16 heads, batches 1-256 and contexts 1K-32K, this count is the fastest of 1-64 splits or within
    3% of it at every shape but one (batch 64 x 1K at 32 heads: 4 splits 88 us, unsplit 81 us). The
    rule before it (num_sms // programs splits of at least 512 tokens) lost up to 2.9x: 16 heads,
    batch 1 x 4K 34.4 us against 13.7 at 64 splits of 64 tokens; batch 64 x 32K 979 against 643
    at 4 splits; 128 heads, batch 1 x 4K 51.8 against 22.6; batch 4 x 4K 61.6 against 46.1.
    """
    programs = max(1, num_seqs * head_blocks)
    context = max(max_context, 1)
    per_sm = PROGRAMS_PER_SM_WIDE if block_h >= 64 else PROGRAMS_PER_SM
    num_splits = min(num_sms * per_sm // programs, triton.cdiv(context, block_n), MAX_SPLITS)
    if num_splits <= 1:
        return 1, triton.cdiv(context, block_n) * block_n
    return num_splits, block_n


def mla_paged_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    *,
    kv_scale: float | torch.Tensor | None = None,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    min_split_len: int | None = None,
    config: MlaConfig | None = None,
) -> torch.Tensor:
    """See atom_kernels.mla_paged_attention. ``num_splits`` / ``min_split_len`` / ``config``
    override the heuristics (tests use them to force several decode splits and small tiles)."""
    # T = query tokens, H = heads, L / R = latent / rope dims, B = sequences
    num_tokens, num_heads, latent_dim = q_latent.shape
    rope_dim = q_pe.shape[2]
    block_size = kv_cache.shape[1]
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)  # [T, H, L]
    if num_tokens == 0:
        return out
    if num_seqs == 0:
        return out.zero_()
    interpreted = is_interpreted(q_latent.device)
    config = config or default_config(latent_dim, q_latent.dtype, interpreted, num_heads)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    block_l, block_r = next_pow2(latent_dim, 16), next_pow2(rope_dim, 16)
    # fp32 inputs keep fp32 dots (no TF32); 16-bit inputs ignore the setting.
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"
    kv_scale_ptr, kv_scale_f, kv_scale_is_ptr = scale_args(kv_scale, seq_lens)
    strides = (
        *q_latent.stride(),
        *q_pe.stride(),
        *kv_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
    )

    if not (max_query_len == 1 and num_tokens == num_seqs):
        block_m = config.prefill_block_m
        num_tiles = num_tokens * num_heads // block_m + num_seqs + 1  # see mla_prefill
        mla_prefill_kernel[(num_tiles,)](
            q_latent,
            q_pe,
            kv_cache,
            out,
            block_tables,
            seq_lens,
            query_start_loc,
            num_seqs,
            num_tokens,
            num_heads,
            latent_dim,
            rope_dim,
            float(scale),
            kv_scale_ptr,
            kv_scale_f,
            *strides,
            KV_SCALE_IS_PTR=kv_scale_is_ptr,
            PRECISION=precision,
            HEAVY_FIRST=config.prefill_heavy_first,
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_N=config.prefill_block_n,
            BLOCK_L=block_l,
            BLOCK_R=block_r,
            num_warps=config.prefill_num_warps,
            num_stages=config.prefill_num_stages,
        )

    block_h, block_n = config.decode_block_h, config.decode_block_n
    head_blocks = triton.cdiv(num_heads, block_h)
    max_context = max(block_tables.shape[1] * block_size, 1)
    if num_splits is None:
        num_splits, min_split_len = choose_splits(
            num_seqs, head_blocks, max_context, num_sms(q_latent.device), block_n, block_h
        )
    elif min_split_len is None:
        min_split_len = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
        num_splits = triton.cdiv(max_context, min_split_len)
    else:
        min_split_len = triton.cdiv(min_split_len, block_n) * block_n
    if num_splits > 1:
        m_part = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=out.device
        )
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(
            (num_seqs, num_heads, num_splits, block_l), dtype=torch.float32, device=out.device
        )
    else:
        m_part = l_part = acc_part = out
    # Eager: the last split of a (sequence, head block) merges the partials (see mla_decode).
    counters = None
    if num_splits > 1 and fuse_decode_reduce(q_latent.device):
        counters = zeroed_counters(q_latent.device, num_seqs * head_blocks)
    # A grid's second dim holds at most 65,535 programs: more sequences go first (grid x).
    head_blocks_first = config.decode_head_blocks_first and num_seqs <= MAX_GRID_Y
    if head_blocks_first:
        grid = (head_blocks, num_seqs, num_splits)
    else:
        grid = (num_seqs, head_blocks, num_splits)
    mla_decode_kernel[grid](
        q_latent,
        q_pe,
        kv_cache,
        out,
        m_part,
        l_part,
        acc_part,
        counters if counters is not None else seq_lens,
        block_tables,
        seq_lens,
        query_start_loc,
        num_heads,
        latent_dim,
        rope_dim,
        min_split_len,
        num_splits,
        float(scale),
        kv_scale_ptr,
        kv_scale_f,
        *strides,
        KV_SCALE_IS_PTR=kv_scale_is_ptr,
        SINGLE_SPLIT=num_splits == 1,
        FUSED_REDUCE=counters is not None,
        PRECISION=precision,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        HEAD_BLOCKS_FIRST=head_blocks_first,
        num_warps=config.decode_num_warps,
        num_stages=config.decode_num_stages,
    )
    if num_splits > 1 and counters is None:
        block_c = min(REDUCE_BLOCK_C, block_l)
        mla_decode_reduce_kernel[(num_seqs, num_heads, triton.cdiv(block_l, block_c))](
            out,
            m_part,
            l_part,
            acc_part,
            seq_lens,
            query_start_loc,
            num_heads,
            latent_dim,
            min_split_len,
            num_splits,
            *out.stride(),
            BLOCK_N=block_n,
            # One width for every split count: no recompile as the table's width changes.
            BLOCK_S=next_pow2(max(num_splits, MAX_SPLITS)),
            BLOCK_L=block_l,
            BLOCK_C=block_c,
            num_warps=4,
        )
    return out
