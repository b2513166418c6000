"""Triton paged attention launcher: picks tile sizes and the decode split, launches the kernels.

Routing is per sequence, on the device: the varlen kernel (attention_prefill) takes the sequences
with more than one query row and zeroes the padding rows; the flash-decoding kernel
(attention_decode) takes the sequences with exactly one. Both are launched for every batch, sized
from shapes alone, so the launcher never reads a device value (no host sync, CUDA-graph safe) and a
mixed batch gets split-KV decode for its decode rows. A kernel whose rows are all elsewhere costs
one launch of programs that exit after reading query_start_loc.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton import pdl
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
FUSED_DECODE_REDUCE = os.environ.get("ATOM_FUSED_DECODE_REDUCE", "0") == "1"


def fuse_decode_reduce(device: torch.device) -> bool:
    """Whether a decode launch with several splits merges them in the kernel (see above)."""
    if not FUSED_DECODE_REDUCE:
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


# ATOM_DECODE_PAGE_CONSTEXPR=1: default_config compiles the decode kernel for the page size
# (AttentionConfig.decode_page_constexpr). Off by default.
DECODE_PAGE_CONSTEXPR = os.environ.get("ATOM_DECODE_PAGE_CONSTEXPR", "0") == "1"

# Programs the decode grid aims for, per SM: enough resident programs to cover memory latency.
PROGRAMS_PER_SM = 2
# From this many (sequence, kv head) programs an SM, the decode kernel takes the config's large
# tiles (see default_config). ATOM_DECODE_LARGE_TILES_FROM overrides it (A/B runs).
LARGE_BATCH_PROGRAMS_PER_SM = float(os.environ.get("ATOM_DECODE_LARGE_TILES_FROM", "8"))
# A batch that fills the GPU may still split long contexts: each sequence into at most
# LARGE_BATCH_SPLITS splits of at least LARGE_BATCH_SPLIT_TOKENS, when the batch has fewer than
# LARGE_BATCH_SPLITS_BELOW (sequence, kv head) programs an SM. Off (1): on one H100
# (benchmarks/tune_decode.py, results/tune-decode-large-batch-h100.json) 256 Qwen3-0.6B sequences
# of 100-2048 tokens took 451 us unsplit, 438 / 442 / 447 us with 2 x 512 / 4 x 512 / 4 x 256
# (2.6 TB/s unsplit: the uneven contexts leave no tail); 64 Llama-3-8B sequences of 4096 took
# 364 us unsplit, 369-390 us split. ATOM_DECODE_LARGE_SPLITS / _SPLIT_TOKENS / _SPLITS_BELOW
# override them (A/B runs; benchmarks/decode_sweep.py times the candidates).
LARGE_BATCH_SPLITS = int(os.environ.get("ATOM_DECODE_LARGE_SPLITS", "1"))
LARGE_BATCH_SPLIT_TOKENS = int(os.environ.get("ATOM_DECODE_LARGE_SPLIT_TOKENS", "512"))
LARGE_BATCH_SPLITS_BELOW = float(os.environ.get("ATOM_DECODE_LARGE_SPLITS_BELOW", "inf"))
if LARGE_BATCH_SPLITS < 1 or LARGE_BATCH_SPLIT_TOKENS < 1:
    raise ValueError(
        "ATOM_DECODE_LARGE_SPLITS and ATOM_DECODE_LARGE_SPLIT_TOKENS must be >= 1, got "
        f"{LARGE_BATCH_SPLITS} and {LARGE_BATCH_SPLIT_TOKENS}"
    )


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch options of the two attention kernels. The decode kernel runs with
    ``decode_block_n`` / ``decode_num_warps`` / ``decode_num_stages`` when the batch leaves SMs
    idle (splits add programs), with ``decode_num_warps_unsplit`` when the batch alone fills the
    GPU, and with the ``_large`` tiles (None: the unsplit ones) from LARGE_BATCH_PROGRAMS_PER_SM
    programs an SM."""

    prefill_block_m: int
    prefill_block_n: int
    prefill_num_warps: int
    prefill_num_stages: int
    decode_block_n: int
    decode_num_warps: int
    decode_num_stages: int
    decode_num_warps_unsplit: int
    decode_block_n_large: int | None = None
    decode_num_warps_large: int | None = None
    decode_num_stages_large: int | None = None
    # Prefill query tiles in reverse order (heaviest causal tiles first; see attention_prefill).
    prefill_heavy_first: bool = True
    # The prefill's unmasked KV loop as tl.range(warp_specialize=True), where this Triton has it
    # and the inputs are 16-bit (see prefill_warp_specialize). Off: see the NOTE there.
    prefill_warp_specialize: bool = False
    # A register cap for the prefill kernel (Triton's maxnreg; None: the compiler's choice): at
    # 8 warps, 128 registers let two programs share an SM (see default_config's NOTE).
    prefill_maxnreg: int | None = None
    # The decode kernel compiled for the cache's page size (a power of two): a token's page and
    # slot by shift and mask, not a runtime division per token row (DECODE_PAGE_CONSTEXPR).
    decode_page_constexpr: bool = False


# Triton >= 3.4 has tl.range(warp_specialize=...); the prefill kernel only names it when asked.
HAS_WARP_SPECIALIZE = "warp_specialize" in inspect.signature(tl.range.__init__).parameters


def prefill_warp_specialize(config: AttentionConfig, dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether the prefill launch warp-specializes its unmasked loop: asked for by the config,
    supported by this Triton, 16-bit inputs (triton 3.6's pass asserts on fp32 tiles), compiled.

    NOTE (sm_90 TTGIR from an AOT compile, triton 3.9, bf16 128x128 / 8 warps): the loop keeps
    its ``tt.warp_specialize`` attribute but no ``ttg.warp_specialize`` partitions are made, and
    the cubin has the plain loop's 255 registers and 160 KB shared: on Hopper, with gathered
    (cp.async, not TMA) K/V the pass does nothing. benchmarks/tune_prefill.py --compare times
    it on the GPU's own Triton.
    """
    return (
        config.prefill_warp_specialize
        and HAS_WARP_SPECIALIZE
        and not interpreted
        and dtype in (torch.float16, torch.bfloat16)
    )


def default_config(
    head_dim: int, dtype: torch.dtype, interpreted: bool, group: int = 1
) -> AttentionConfig:
    """Tiles for a head dim (padded to a power of two), the query dtype and the GQA group size.

    NOTE: registers / spills from sm_90 cubins (triton 3.9 AOT builds, read with cuobjdump):
    bf16, D=128: prefill 128x64 / 8 warps takes 222 registers, decode with a 64-token tile 134
    (179 at 2 warps), none spills; 64x64 / 4 warps prefill spills at D=128. Timings on one H200
    (triton 3.6, torch 2.11, CUDA-graph medians, Llama-3-8B heads, bf16): prefill 2K causal
    128x64/8w/3 stages 185 us vs 196 us at 2 stages and 219 us at 64x64/4w; 2K over a 6K prefix
    925 vs 1007 us. Decode B=64 x 4K (no split) 274 us at 2 warps vs 358 us at 4; B=8 x 4K
    (5 splits) 52 us at 4 warps vs 59 us at 2; B=1 x 1K 9.8 us with 128-token splits vs 13.7 us
    with 256. fp32 queries keep IEEE fp32 dots, which run on the FMA units and spill at larger
    tiles, so they get small ones (fp32 is for tests, not speed). Decode groups of >= 64 heads
    shrink the KV tile.

    NOTE (after the prefill rewrite: page ids carried one tile ahead, FMA-scaled exp2; sm_90
    cubins, bf16, D=128, no spills at triton 3.6 / 3.9): prefill 128x64/8w/3 stages 202 / 176
    registers with three K/V buffers (128 KB shared); 128x128/8w 254-255 registers, 160 KB at 2
    stages, 224 KB at 3. benchmarks/tune_prefill.py sweeps these on the GPU. On one H100 (triton
    3.6, torch 2.11, CUDA graphs, 32 / 8 heads, bf16, 2026-11-22): 4K causal 128x128/8w/2 stages
    364 TFLOP/s, 128x64/8w/3 350, 64x64/4w/3 329; 2K causal 299 / 293 / 306
    (benchmarks/results/tune-prefill-h100.json).

    NOTE (why the 8-warp tiles run one program an SM; sm_90 cubins, triton 3.9 AOT, bf16, D=128,
    read with cuobjdump): 128x128/8w/2 stages takes 255 registers and 160 KB shared, 128x64/8w/2
    194 registers, so one 256-thread program an SM, whose two warpgroups meet at a barrier every
    KV tile (the cp.async wait): softmax and MMA of the SM do not overlap. With 2 stages the K/V
    copies of tile i+1 are issued at the end of tile i and waited for at the top of i+1 (async_wait
    num=0): their latency is covered by the PV product only. 128x32/8w/3 or 4 stages fit 128
    registers (prefill_maxnreg=128) with no spill inside the KV loops (the 10 spilled registers
    are loads and stores outside them) in 80 / 96 KB shared: two programs an SM, out of step.
    128x64/8w/2 at 128 registers spills inside the loops (5 and 25 LDL/STL) at triton 3.9.

    NOTE (benchmarks/tune_prefill.py --compare, one H100, triton 3.6, torch 2.11, 32 / 8 heads,
    bf16, D=128, 2026-11-24, results/s10-h100/tune-prefill-compare.json; every launch checked
    against the reference): 128x64/8w/2 stages capped at 128 registers (two programs an SM) is
    the fastest of 12: 4K causal 406 TFLOP/s against 366 for the former default 128x128/8w/2,
    2K causal 357 / 301, 4K over a 6K prefix 428 / 392. 128x32/8w at 128 registers: 348-364
    (4K); warp specialization changes nothing (Hopper: no partitions made).

    NOTE (benchmarks/tune_decode.py --large-tiles, one H100, triton 3.6, 2026-11-22,
    results/tune-decode-large-tiles-h100.json): unsplit batches, D=128: 128-token KV tiles, 4
    warps, 2 stages (128 KB shared) against 64 / 2 warps / 3 stages: 256 Qwen3-0.6B sequences
    of 100-2048 tokens 396 vs 428 us, 256 Llama-3-8B of 512-768 241 vs 245 us, 64 Llama-3-8B of
    1024 97 vs 96 us (3 stages: 389 / 239 / 96 us, 192 KB shared); in the engine's batch-64
    decode step (contexts ~530) the 128-token tiles cost 3-4% (Qwen3 3.02 vs 2.90 ms): they run
    from LARGE_BATCH_PROGRAMS_PER_SM programs an SM (batch 256 x 8 kv heads), not at batch 64.
    """
    config = _default_tiles(head_dim, dtype, interpreted, group)
    return replace(config, decode_page_constexpr=DECODE_PAGE_CONSTEXPR)


def _default_tiles(
    head_dim: int, dtype: torch.dtype, interpreted: bool, group: int
) -> AttentionConfig:
    """default_config's tiles (see its NOTEs)."""
    if interpreted:  # small tiles: several KV tiles and query tiles even at test sizes
        return AttentionConfig(16, 16, 4, 1, 16, 4, 1, 4)
    block_d = next_pow2(head_dim, 16)
    if dtype == torch.float32:
        return AttentionConfig(32, 16, 4, 2, 32, 4, 2, 4)
    if block_d <= 64:
        config = AttentionConfig(64, 64, 4, 3, 64, 4, 3, 2)
    elif block_d <= 128:
        config = AttentionConfig(128, 64, 8, 2, 64, 4, 3, 2, 128, 4, 2, prefill_maxnreg=128)
    else:
        config = AttentionConfig(64, 32, 8, 2, 32, 4, 2, 4)
    block_g = next_pow2(group, 16)
    if block_g >= 64:
        decode_block_n = 16 if block_g >= 128 else 32
        config = replace(
            config,
            decode_block_n=min(config.decode_block_n, decode_block_n),
            decode_block_n_large=min(config.decode_block_n, decode_block_n),
            decode_num_warps_unsplit=4,
            decode_num_warps_large=4,
        )
    return config


def choose_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int, block_n: int
) -> tuple[int, int]:
    """(num_splits, min_split_len) of the decode grid (num_seqs, num_kv_heads, num_splits).

    Each sequence cuts its context into at most num_splits splits of at least min_split_len
    tokens (a multiple of block_n; see attention_decode). ``max_context`` is what the block table
    can hold (shapes only: no host sync); a decode graph's table is as wide as max_model_len while
    the batch's contexts are often much shorter.

    When the batch alone does not give every SM PROGRAMS_PER_SM programs: splits of
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
    target = PROGRAMS_PER_SM * num_sms
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
    block_n, num_warps, num_stages = (
        config.decode_block_n, config.decode_num_warps, config.decode_num_stages
    )  # fmt: skip
    if programs_per_sm >= LARGE_BATCH_PROGRAMS_PER_SM:
        block_n = config.decode_block_n_large or block_n
        num_warps = config.decode_num_warps_large or config.decode_num_warps_unsplit
        num_stages = config.decode_num_stages_large or num_stages
    elif programs_per_sm >= PROGRAMS_PER_SM:  # the batch alone fills the GPU: no split
        num_warps = config.decode_num_warps_unsplit
    if num_splits is None:
        num_splits, min_split_len = choose_splits(
            num_seqs, num_kv_heads, max_context, num_sms(query.device), block_n
        )
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
