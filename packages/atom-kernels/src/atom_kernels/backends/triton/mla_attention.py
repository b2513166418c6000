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

from atom_kernels.backends.triton.attention import MAX_SPLITS, choose_splits
from atom_kernels.backends.triton.common import is_interpreted, next_pow2, num_sms
from atom_kernels.backends.triton.mla_decode import mla_decode_kernel, mla_decode_reduce_kernel
from atom_kernels.backends.triton.mla_prefill import mla_prefill_kernel

# Latent columns per program of the split reduce: [MAX_SPLITS, 64] fp32 partials a program.
REDUCE_BLOCK_C = 64


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


def default_config(latent_dim: int, dtype: torch.dtype, interpreted: bool) -> MlaConfig:
    """Tiles for a latent dim (padded to a power of two) and the query dtype.

    NOTE: not tuned on a GPU yet. The sizes keep the fp32 accumulator [M, BLOCK_L] at 64 registers
    a thread for DeepSeek's L = 512 (32 x 512 over 8 warps in prefill, 16 x 512 over 4 warps in
    decode) and a latent tile of 32 x 512 bf16 (32 KB) a pipeline stage. fp32 queries (tests) get
    smaller KV tiles.
    """
    if interpreted:  # small tiles: several KV tiles and tiles of pairs even at test sizes
        return MlaConfig(16, 16, 4, 1, 16, 16, 4, 1)
    block_l = next_pow2(latent_dim, 16)
    if dtype == torch.float32:
        return MlaConfig(16, 16, 4, 2, 16, 16, 4, 2)
    if block_l <= 128:
        return MlaConfig(64, 64, 4, 2, 16, 64, 4, 2)
    return MlaConfig(32, 32, 8, 2, 16, 32, 4, 2)


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
    config = config or default_config(latent_dim, q_latent.dtype, is_interpreted(q_latent.device))
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    block_l, block_r = next_pow2(latent_dim, 16), next_pow2(rope_dim, 16)
    # fp32 inputs keep fp32 dots (no TF32); 16-bit inputs ignore the setting.
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"
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
            *strides,
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
            num_seqs, head_blocks, max_context, num_sms(q_latent.device), block_n
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
    mla_decode_kernel[(num_seqs, head_blocks, num_splits)](
        q_latent,
        q_pe,
        kv_cache,
        out,
        m_part,
        l_part,
        acc_part,
        block_tables,
        seq_lens,
        query_start_loc,
        num_heads,
        latent_dim,
        rope_dim,
        block_size,
        min_split_len,
        num_splits,
        float(scale),
        *strides,
        SINGLE_SPLIT=num_splits == 1,
        PRECISION=precision,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        num_warps=config.decode_num_warps,
        num_stages=config.decode_num_stages,
    )
    if num_splits > 1:
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
