"""Triton paged attention launcher: picks tile sizes and the decode split, launches the kernels.

Routing is per sequence, on the device: the varlen kernel (attention_prefill) takes the sequences
with more than one query row and zeroes the padding rows; the flash-decoding kernel
(attention_decode) takes the sequences with exactly one. Both are launched for every batch, sized
from shapes alone, so the launcher never reads a device value (no host sync, CUDA-graph safe) and a
mixed batch gets split-KV decode for its decode rows. A kernel whose rows are all elsewhere costs
one launch of programs that exit after reading query_start_loc.
"""

from __future__ import annotations

import torch
import triton

from atom_kernels import envs
from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.attention_config import (  # noqa: F401 (re-exported)
    HAS_WARP_SPECIALIZE,
    LARGE_BATCH_PROGRAMS_PER_SM,
    PROGRAMS_PER_SM,
    AttentionConfig,
    default_config,
    prefill_warp_specialize,
)
from atom_kernels.backends.triton.attention_decode import decode_kernel, decode_reduce_kernel
from atom_kernels.backends.triton.attention_prefill import prefill_kernel
from atom_kernels.backends.triton.common import (
    is_interpreted,
    next_pow2,
    num_sms,
    scale_args,
    zeroed_counters,
)

# Decode splits: a split holds at least this many KV tokens (shorter ones cost more in partial
# writes and the reduce than they win in parallelism), and there are at most MAX_SPLITS of them.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64
# ATOM_FUSED_DECODE_REDUCE=1: eager launches merge a decode's splits in the decode kernel (its
# last split, see attention_decode) instead of a second kernel; graph captures keep the reduce
# kernel. Off by default.
# NOTE (benchmarks/results/fused-reduce-h100 and s9-final-h100, one H100, 2026-11-24, two
# alternating rounds each, Qwen3-0.6B shape): merging in the kernel inside the decode graphs took
# 1.50 / 1.50 ms a step at batch 1 against 1.47 / 1.47 with the reduce kernel; in the eager
# attention between piecewise graphs (eager_steps.py, 128 x 512/128) the mixed steps' median was
# 13.9 / 14.1 ms against 13.1 / 13.3: one launch fewer from Python does not pay for the merge's
# serial tail.
# ATOM_FUSED_DECODE_REDUCE=2 merges inside graph captures too (A/B). NOTE (decode_ab.sh, one
# H100, PDL on, 2026-11-24, results/s12-h100/h17a-call1): Llama-3-8B batch 1 6.021 / 6.010 ms a step
# with it against 5.875 / 5.880 without (the same other switches), batch 8 6.273 / 6.277 against
# 6.290 / 6.301: at batch 1 the last split's serial merge costs more than the launch it saves.
FUSED_DECODE_REDUCE = envs.ATOM_FUSED_DECODE_REDUCE in ("1", "2")
FUSED_DECODE_REDUCE_IN_GRAPHS = envs.ATOM_FUSED_DECODE_REDUCE == "2"


def fuse_decode_reduce(device: torch.device) -> bool:
    """Whether a decode launch with several splits merges them in the kernel (see above)."""
    if not FUSED_DECODE_REDUCE:
        return False
    if FUSED_DECODE_REDUCE_IN_GRAPHS:
        return True
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


# A batch that fills the GPU may still split long contexts: each sequence into at most
# LARGE_BATCH_SPLITS splits of at least LARGE_BATCH_SPLIT_TOKENS, when the batch has fewer than
# LARGE_BATCH_SPLITS_BELOW (sequence, kv head) programs an SM. Off (1): on one H100
# (benchmarks/tune_decode.py, results/tune-decode-large-batch-h100.json) 256 Qwen3-0.6B sequences
# of 100-2048 tokens took 451 us unsplit, 438 / 442 / 447 us with 2 x 512 / 4 x 512 / 4 x 256
# (2.6 TB/s unsplit: the uneven contexts leave no tail); 64 Llama-3-8B sequences of 4096 took
# 364 us unsplit, 369-390 us split. ATOM_DECODE_LARGE_SPLITS / _SPLIT_TOKENS / _SPLITS_BELOW
# override them (A/B runs; benchmarks/decode_sweep.py times the candidates).
LARGE_BATCH_SPLITS = envs.ATOM_DECODE_LARGE_SPLITS
LARGE_BATCH_SPLIT_TOKENS = envs.ATOM_DECODE_LARGE_SPLIT_TOKENS
LARGE_BATCH_SPLITS_BELOW = envs.ATOM_DECODE_LARGE_SPLITS_BELOW
if LARGE_BATCH_SPLITS < 1 or LARGE_BATCH_SPLIT_TOKENS < 1:
    raise ValueError(
        "ATOM_DECODE_LARGE_SPLITS and ATOM_DECODE_LARGE_SPLIT_TOKENS must be >= 1, got "
        f"{LARGE_BATCH_SPLITS} and {LARGE_BATCH_SPLIT_TOKENS}"
    )


def choose_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    num_sms: int,
    block_n: int,
    programs_per_sm: float = PROGRAMS_PER_SM,
) -> tuple[int, int]:
    """(num_splits, min_split_len) of the decode grid (num_seqs, num_kv_heads, num_splits).

    Each sequence cuts its context into at most num_splits splits of at least min_split_len
    tokens (a multiple of block_n; see attention_decode). ``max_context`` is what the block table
    can hold (shapes only: no host sync); a decode graph's table is as wide as max_model_len while
    the batch's contexts are often much shorter.

    When the batch alone does not give every SM ``programs_per_sm`` programs (PROGRAMS_PER_SM;
    a config's ``decode_unsplit_from``): splits of
    MIN_SPLIT_TOKENS tokens (at most MAX_SPLITS). H100, 8 kv heads, table of 4096 tokens, contexts
    of 512 / 1024 / 2048 (benchmarks/tune_decode.py): batch 8 took 20.3 / 31.7 / 42.9 us with
    splits sized to fill the SMs (5) and 11.6 / 19.2 / 34.4 us with 32 splits of 128; batch 1
    8.8 / 8.9 / 9.1 us either way (32 splits). When even those programs leave SMs idle (batch 1),
    splits are halved once to 64 tokens: batch 1, 4096-token table, context 512 / 1024 / 2048:
    7.4 / 8.2 / 9.4 us with 64 splits. A batch that fills the GPU: LARGE_BATCH_SPLITS splits of
    at least LARGE_BATCH_SPLIT_TOKENS while it has fewer than LARGE_BATCH_SPLITS_BELOW programs
    an SM, else none.
    """
    context = max(max_context, 1)
    programs = max(1, num_seqs * num_kv_heads)
    target = programs_per_sm * num_sms
    if programs >= target:
        split_len = triton.cdiv(LARGE_BATCH_SPLIT_TOKENS, block_n) * block_n
        split = LARGE_BATCH_SPLITS > 1 and programs < LARGE_BATCH_SPLITS_BELOW * num_sms
        if split and context > split_len:
            return min(LARGE_BATCH_SPLITS, triton.cdiv(context, split_len)), split_len
        return 1, triton.cdiv(context, block_n) * block_n
    num_splits = 1
    if context > MIN_SPLIT_TOKENS:
        num_splits = min(triton.cdiv(context, MIN_SPLIT_TOKENS), MAX_SPLITS)
        if programs * num_splits < target:
            num_splits = min(triton.cdiv(context, MIN_SPLIT_TOKENS // 2), MAX_SPLITS)
    split_len = triton.cdiv(triton.cdiv(context, num_splits), block_n) * block_n
    return triton.cdiv(context, split_len), split_len


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
    *,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    min_split_len: int | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """See atom_kernels.paged_attention. ``num_splits`` / ``min_split_len`` / ``config`` override
    the heuristics (tests use them to force several decode splits and small tiles; a forced
    ``num_splits`` alone cuts the table's width evenly)."""
    # T = query tokens, H / Hk = query / kv heads, D / Dv = key / value head dims, B = sequences
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    head_dim_v = value_cache.shape[3]
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty(
            (num_tokens, num_heads, head_dim_v), dtype=query.dtype, device=query.device
        )  # [T, H, Dv]
    if num_tokens == 0:
        return out
    if num_seqs == 0:
        return out.zero_()
    interpreted = is_interpreted(query.device)
    config = config or default_config(head_dim, query.dtype, interpreted, num_heads // num_kv_heads)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    sinks = sinks.contiguous() if sinks is not None else None
    k_scale_ptr, k_scale_f, k_is_ptr = scale_args(k_scale, query)
    v_scale_ptr, v_scale_f, v_is_ptr = scale_args(v_scale, query)
    block_d, block_dv = next_pow2(head_dim, 16), next_pow2(head_dim_v, 16)
    flags = dict(
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=soft_cap is not None,
        K_SCALE_IS_PTR=k_is_ptr,
        V_SCALE_IS_PTR=v_is_ptr,
        # fp32 inputs keep fp32 dots (no TF32); 16-bit inputs ignore the setting.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
    )
    common = (
        num_heads // num_kv_heads,
        head_dim,
        head_dim_v,
        block_size,
    )
    values = (
        float(scale),
        k_scale_f,
        v_scale_f,
        float(soft_cap) if soft_cap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
    )
    dummy = query
    block_m = config.prefill_block_m
    # A decode-only batch (one row per sequence, known from the caller's hint) has no prefill row
    # and no padding row: the prefill grid would only exit (~2-8 us a layer in a decode graph).
    if not (max_query_len == 1 and num_tokens == num_seqs):
        num_tiles = num_tokens // block_m + num_seqs + 1  # an upper bound (see attention_prefill)
        prefill_kernel[(num_tiles * num_heads,)](
            query,
            key_cache,
            value_cache,
            out,
            block_tables,
            seq_lens,
            query_start_loc,
            sinks if sinks is not None else dummy,
            k_scale_ptr,
            v_scale_ptr,
            num_seqs,
            num_tokens,
            num_heads,
            *common[:3],  # the page size is a compile-time constant there
            *values,
            EVEN_D=head_dim == block_d and head_dim_v == block_dv,
            HEAVY_FIRST=config.prefill_heavy_first,
            WARP_SPECIALIZE=prefill_warp_specialize(config, query.dtype, interpreted),
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_N=config.prefill_block_n,
            num_warps=config.prefill_num_warps,
            num_stages=config.prefill_num_stages,
            **flags,
            **({"maxnreg": config.prefill_maxnreg} if config.prefill_maxnreg else {}),
        )

    max_context = max(block_tables.shape[1] * block_size, 1)
    programs_per_sm = num_seqs * num_kv_heads / num_sms(query.device)
    block_n, num_warps, num_stages = config.decode_tile(programs_per_sm)
    if num_splits is None:
        num_splits, min_split_len = choose_splits(
            num_seqs, num_kv_heads, max_context, num_sms(query.device), block_n,
            config.unsplit_from(),
        )  # fmt: skip
    elif min_split_len is None:
        min_split_len = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
        num_splits = triton.cdiv(max_context, min_split_len)
    else:
        min_split_len = triton.cdiv(min_split_len, block_n) * block_n
    group = num_heads // num_kv_heads
    if num_splits > 1:
        m_part = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=out.device
        )
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(
            (num_seqs, num_heads, num_splits, block_dv), dtype=torch.float32, device=out.device
        )
    else:
        m_part = l_part = acc_part = out
    # Eager: the last split of a (sequence, kv head) merges the partials (no reduce kernel).
    counters = None
    if num_splits > 1 and fuse_decode_reduce(query.device):
        counters = zeroed_counters(query.device, num_seqs * num_kv_heads)
    use_pdl = pdl.enabled(query.device)
    page_constexpr = config.decode_page_constexpr and block_size & (block_size - 1) == 0
    decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        m_part,
        l_part,
        acc_part,
        counters if counters is not None else seq_lens,
        block_tables,
        seq_lens,
        query_start_loc,
        sinks if sinks is not None else dummy,
        k_scale_ptr,
        v_scale_ptr,
        num_heads,
        *common,
        min_split_len,
        num_splits,
        *values,
        SINGLE_SPLIT=num_splits == 1,
        FUSED_REDUCE=counters is not None,
        BLOCK_G=next_pow2(group, 16),
        BLOCK_N=block_n,
        USE_PDL=use_pdl,
        PAGE_SIZE=block_size if page_constexpr else 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **flags,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    if num_splits > 1 and counters is None:
        decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            m_part,
            l_part,
            acc_part,
            seq_lens,
            query_start_loc,
            sinks if sinks is not None else dummy,
            num_heads,
            head_dim_v,
            min_split_len,
            num_splits,
            *out.stride(),
            HAS_SINKS=sinks is not None,
            BLOCK_N=block_n,
            # One width for every split count: no recompile as the table's width changes.
            BLOCK_S=next_pow2(max(num_splits, MAX_SPLITS)),
            BLOCK_DV=block_dv,
            USE_PDL=use_pdl,
            num_warps=4,
            **({"launch_pdl": True} if use_pdl else {}),
        )
    return out
