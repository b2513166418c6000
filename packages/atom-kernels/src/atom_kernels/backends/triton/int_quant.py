"""Triton integer-quantized linears (layouts: ``atom_kernels.ops.int_quant``): WNA16 (4- or 8-bit
weights packed in int32, 16-bit / fp32 activations) and W8A8 (int8 x int8 -> int32).

M = rows of x, N = output features, K = input features, G = scale groups along K.

WNA16: one kernel, three shapes of launch. Each program owns a [BLOCK_M, BLOCK_N] output tile and
walks its K range in BLOCK_K steps: the [BLOCK_N, BLOCK_K * bits / 32] int32 words of the tile load
as one wide contiguous block per row, unpack in registers (shift, mask; the integer becomes a
float by OR-ing it into the mantissa of 2**23, no int->float conversion), and ``(q - zero) * scale``
is applied with one scale (and zero) per row when the tile lies in one group (``SCALE_PER_TILE``:
BLOCK_K divides the group size), else gathered per element (odd group sizes, ``g_idx``). Then:
- 1..SKINNY_MAX_ROWS rows (decode): ``tl.dot`` with 16-row x tiles (``wna16_config`` says why
  one row too); on a tile-wide scale the dot multiplies q - zero (small integers, exact in x's
  dtype) and its result is scaled (``SCALE_LATER``), else the scaled weight, rounded to x's dtype
  (as the torch reference rounds it), goes into the dot. Where a word lies in one group (no
  g_idx), decode walks K permuted (``PERMUTED_K``, ``_permuted_k_loop``): value j of each word
  of the tile is a [BLOCK_N, BLOCK_K * bits / 32] slice met by x at the same k (a strided x
  load), one dot per j, with no unpacking reshape (the interleaved loop's layout conversions);
- a launch with BLOCK_M = 1 (one row): fp32 multiply-adds into a [BLOCK_N, BLOCK_K]
  accumulator ([BLOCK_N, BLOCK_K * bits / 32] when permuted), summed over K once at the end;
  with 4-bit weights and 16-bit x on NVIDIA (the default there) ``mma.sync`` in inline PTX on
  the words as each thread loads them, no shared memory: a warp on one row
  (``int_quant_row_mma``) or on 8 (``int_quant_quad_mma``);
- more rows (prefill): the same with 64 / 128-row tiles and GROUP_M ordering (L2 reuse of W).
``config={"PERMUTED_K": False}`` forces the interleaved loop (benchmarks time both).
Few output tiles split K (``split_for``): fp32 partials in a workspace, the tile's last program to
arrive sums them in split order (deterministic) and finishes the tile (counters as linear.py).

W8A8: x is quantized per token (or with the static per-tensor scale) by ``_int8_quant_kernel``
(round half to even as ``torch.round``), then ``_int8_gemm_kernel`` sums int8 products exactly in
int32 (split-K partials too) and scales in float64 in the epilogue, the reference's arithmetic:
the output equals the torch reference bit for bit.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton.common import as_rows, is_interpreted, num_sms, zeroed_counters
from atom_kernels.backends.triton.int_quant_frag import frag_usable, wna16_frag_linear
from atom_kernels.backends.triton.int_quant_packed_dot import _packed_dot_k_loop
from atom_kernels.backends.triton.int_quant_quad_mma import _quad_mma_k_loop
from atom_kernels.backends.triton.int_quant_row_mma import (
    _row_mma_k_loop,
    _row_mma_strided_k_loop,
)
from atom_kernels.backends.triton.int_quant_small_magic import (
    SMALL_MAGIC_VARIANTS,
    _small_magic_k_loop,
)
from atom_kernels.backends.triton.split_k import _split_k_sum
from atom_kernels.ops.int_quant_frag import frag_shape, is_frag

SKINNY_MAX_ROWS = 16
# The packed-unpack dots (int_quant_packed_dot) from PACKED_DOT_MIN_ROWS to PACKED_DOT_MAX_ROWS
# rows (wna16_config says why); ATOM_WNA16_PACKED_DOT=0 turns them off. Read at import (tests and
# benchmarks patch it).
PACKED_DOT_ENABLED = envs.ATOM_WNA16_PACKED_DOT
# The one-row quads' MMAs (int_quant_quad_mma) by default where they fit (wna16_config says why);
# ATOM_WNA16_QUAD=0 turns them off. Read at import (tests and benchmarks patch it).
QUAD_ENABLED = envs.ATOM_WNA16_QUAD
# ROW_MMA with the scale after its MMAs where the groups allow (ROW_SCALE_AFTER: groups of a
# multiple of 128 values); ATOM_WNA16_ROW_SCALE_AFTER=1 turns it on (an A/B, measured slower).
ROW_SCALE_AFTER_ENABLED = envs.ATOM_WNA16_ROW_SCALE_AFTER
# ROW_MMA without the zero and the scale on the weights (ROW_XSUM: bf16 x, groups of a multiple of
# 128 values) and ROW_MMA's steps with only their weights loaded first (ROW_AHEAD: each tile's x
# at its math); A/Bs, off (session 35: XSUM no faster, AHEAD slower).
ROW_XSUM_ENABLED = envs.ATOM_WNA16_ROW_XSUM
ROW_AHEAD_ENABLED = envs.ATOM_WNA16_ROW_AHEAD
# ROW_MMA with lane l on words l + 32 i of a tile (ROW_STRIDED: the x loads contiguous); an A/B,
# off (session 35: 1.5x slower).
ROW_STRIDED_ENABLED = envs.ATOM_WNA16_ROW_STRIDED
PACKED_DOT_MIN_ROWS = 2
PACKED_DOT_MAX_ROWS = 16
# From this many rows the default's packed dots read x as one load split in registers (X_SPLIT)
PACKED_DOT_X_SPLIT_FROM = 8
PACKED_DOT_DTYPES = (torch.bfloat16, torch.float16)
# QUAD_MMA's K tile (int_quant_quad_mma: 16 words of a row, 128 4-bit values) and the default
# launch's K tiles a step (QUAD_STEP).
QUAD_BLOCK_K = 128
QUAD_DEFAULT_STEP = 2
# ROW_MMA's K tile (int_quant_row_mma: 128 words of a row, 1024 4-bit values).
ROW_BLOCK_K = 1024
# The fewest K tiles a split of a ``fill`` launch takes (split_for).
FILL_MIN_K_TILES = 4
# The most rows the permuted K loop takes by default (wna16_config says why).
PERMUTED_MAX_ROWS = 4
# The shallowest K of a tl.dot on a GPU (the interpreter takes any).
MIN_DOT_K = 16
# 1.5 * 2**23: adding and subtracting it rounds an fp32 |y| < 2**22 to an integer, half to even
# (the FPU's round-to-nearest-even), as torch.round. libdevice.rint would do the same on a GPU but
# the interpreter has no libdevice; LLVM does not reassociate the two adds (no fast-math flags;
# test_int_quant_compile_sm90 finds both in the PTX). A constexpr: jit code reads no other global.
ROUND_MAGIC = tl.constexpr(12582912.0)


# --- WNA16 ----------------------------------------------------------------------------------------


@triton.jit
def value_minus_zero(words, j: tl.constexpr, zero, BITS: tl.constexpr):
    """Value j of each int32 word (the layout's k = PER_INT * word + j) minus ``zero``, in
    float32, exactly (integer zeros). The value is masked in place, no shift (the upper half of
    the word from ``words >> 16``, one shift a word, CSE'd across j): at bit p < 23 - BITS its
    bits OR-ed into the exponent of 2**(23 - p) make the float 2**(23 - p) + q (mantissa ulp
    2**-p), so one AND-OR (a LOP3) and a subtraction give q - zero, no int->float conversion."""
    HALF: tl.constexpr = 16 // BITS
    pos: tl.constexpr = BITS * (j % HALF)
    src = words >> (16 * (j // HALF))
    q = (src & (((1 << BITS) - 1) << pos)) | ((150 - pos) << 23)  # 150 = 127 + 23
    return q.to(tl.float32, bitcast=True) - ((1 << (23 - pos)) + zero)


@triton.jit
def _dequant_tile(
    q_ptr,  # [N, K * BITS / 32] int32
    s_ptr,  # [N, G]
    z_ptr,  # [N, G] or dummy
    g_ptr,  # [K] int32 or dummy
    rows,  # [BLOCK_N] int64, in bounds
    k0,  # the tile's first k (a multiple of BLOCK_K)
    K,
    group_size,
    stride_qn,
    stride_sn,
    stride_zn,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_LATER: tl.constexpr = False,
    FRAG: tl.constexpr = False,
):
    """(the fp32 weight tile [BLOCK_N, BLOCK_K] at k0, the scales); with SCALE_LATER and
    SCALE_PER_TILE: (q - zero, the tile's scales [BLOCK_N]), for the caller to scale a whole
    dot's result. k past K gives finite garbage (x is zero there). ``FRAG``: the weight in the
    fragment layout (``ops/int_quant_frag.py``; K a multiple of 64), ``stride_qn`` its row
    blocks' stride (K / 64 * 128 words), ``stride_sn`` / ``stride_zn`` the scales' and zeros'
    (G * 16)."""
    PER_INT: tl.constexpr = 32 // BITS
    BLOCK_KP: tl.constexpr = BLOCK_K // PER_INT
    offs_kp = k0 // PER_INT + tl.arange(0, BLOCK_KP)
    if FRAG:  # word kw of row n: block n // 16, step kw // 8, lane 4 (n % 8) + kw % 8 // 2
        rows_q = (rows // 16) * stride_qn + (rows % 8) * 16 + (rows % 16) // 8 * 2
        cols_q = (offs_kp // 8) * 128 + (offs_kp % 8) // 2 * 4 + offs_kp % 2
        q_ptrs = q_ptr + rows_q[:, None] + cols_q[None, :]
    else:
        q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_kp[None, :]  # [BLOCK_N, BLOCK_KP]
    if EVEN_K:
        words = tl.load(q_ptrs)
    else:  # K is a multiple of PER_INT: a word is wholly in K or wholly past it
        words = tl.load(q_ptrs, mask=(offs_kp * PER_INT < K)[None, :], other=0)
    if FRAG:  # value i at nibble i // 2 + 4 (i % 2)
        values = tl.arange(0, PER_INT)
        shifts = (values // 2 + (values % 2) * 4) * BITS
    else:
        shifts = tl.arange(0, PER_INT) * BITS
    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)  # lowest bits first
    # q | 0x4B000000 is the float 2**23 + q (q < 2**23 in the mantissa): exact, no conversion
    f = tl.reshape((q | 0x4B000000).to(tl.float32, bitcast=True), [BLOCK_N, BLOCK_K])
    if FRAG:  # [block, group, g, hi]: groups 16 apart
        s_rows = (rows // 16) * stride_sn + (rows % 8) * 2 + (rows % 16) // 8
        z_rows = (rows // 16) * stride_zn + (rows % 8) * 2 + (rows % 16) // 8
        s_group = 16
    else:
        s_rows = rows * stride_sn
        z_rows = rows * stride_zn
        s_group = 1
    if SCALE_PER_TILE:  # one group for the whole tile
        group = k0 // group_size
        s = tl.load(s_ptr + s_rows + group * s_group).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + z_rows + group * s_group).to(tl.float32)
        else:
            z = tl.full([BLOCK_N], 1 << (BITS - 1), tl.float32)
        w = f - (8388608.0 + z)[:, None]  # q - zero, exactly (small integers)
        if not SCALE_LATER:
            w = w * s[:, None]
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if HAS_G_IDX:
            groups = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        else:
            groups = tl.where(k_mask, offs_k // group_size, 0)
        s = tl.load(s_ptr + s_rows[:, None] + groups[None, :] * s_group).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + z_rows[:, None] + groups[None, :] * s_group).to(tl.float32)
            w = (f - (8388608.0 + z)) * s
        else:
            w = (f - (8388608.0 + (1 << (BITS - 1)))) * s
    return w, s


@triton.jit
def _interleaved_k_loop(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size,
    stride_xm, stride_qn, stride_sn, stride_zn, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr, SCALE_PER_TILE: tl.constexpr, SCALE_LATER: tl.constexpr,
    ONE_ROW: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FRAG: tl.constexpr = False,
):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] fp32 sums of k_lo <= k < k_hi over weight tiles in k order
    (``_dequant_tile``): any groups, g_idx included; ``FRAG``: the fragment layout."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK]
    if ONE_ROW:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w, s = _dequant_tile(
            q_ptr, s_ptr, z_ptr, g_ptr, rows, k0, K, group_size, stride_qn, stride_sn, stride_zn,
            BITS, HAS_ZEROS, HAS_G_IDX, SCALE_PER_TILE, EVEN_K, BLOCK_N, BLOCK_K, SCALE_LATER,
            FRAG,
        )  # fmt: skip
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        else:
            x_mask = m_mask[:, None] & ((k0 + offs_k) < K)[None, :]
            x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0)
        if ONE_ROW:
            acc2 += w * x.to(tl.float32)  # x is [1, BLOCK_K]
        elif SCALE_LATER:
            if IEEE:
                part = tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            acc += part * s[None, :]
        elif IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    if ONE_ROW:
        acc = tl.reshape(tl.sum(acc2, axis=1), [BLOCK_M, BLOCK_N])
    return acc


@triton.jit
def _permuted_k_loop(
    x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size, stride_xm,
    stride_qn, stride_sn, stride_zn, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr, ONE_ROW: tl.constexpr, IEEE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] fp32 sums of k_lo <= k < k_hi with no interleave (PERMUTED_K): a
    dot product does not care about the order of its K, so value j of every word of a K tile is
    one [BLOCK_N, BLOCK_KP] slice (column w: k = k0 + PER_INT * w + j, masked in place), met by
    the x values of the same k (a strided load of x, which is small and cached).
    No [BLOCK_N, BLOCK_KP, PER_INT] -> [BLOCK_N, BLOCK_K] reshape, hence no layout conversion
    for it. ONE_ROW: fp32 multiply-adds into a [BLOCK_N, BLOCK_KP] sum, scaled once a tile;
    else PER_INT dots a tile, of q - zero (exact in x's dtype) scaled after the tile's dots on a
    tile-wide scale, else of the scaled weight rounded to x's dtype (the reference's numbers).
    Without SCALE_PER_TILE the scales (and zeros) are gathered per word (group_size is a
    multiple of PER_INT: a word lies in one group)."""
    PER_INT: tl.constexpr = 32 // BITS
    BLOCK_KP: tl.constexpr = BLOCK_K // PER_INT
    offs_kp = tl.arange(0, BLOCK_KP)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_kp[None, :]  # [BLOCK_N, BLOCK_KP]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (offs_kp * PER_INT)[None, :]
    if ONE_ROW:
        acc2 = tl.zeros([BLOCK_N, BLOCK_KP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kp0 = k0 // PER_INT
        if EVEN_K:
            kp_mask = tl.full([BLOCK_KP], 1, tl.int1)
            words = tl.load(q_ptrs + kp0)
        else:  # K is a multiple of PER_INT: a word is wholly in K or wholly past it
            kp_mask = (kp0 + offs_kp) * PER_INT < K
            words = tl.load(q_ptrs + kp0, mask=kp_mask[None, :], other=0)
        x_mask = m_mask[:, None] & kp_mask[None, :]
        if SCALE_PER_TILE:  # one group for the whole tile: [BLOCK_N] vectors
            group = k0 // group_size
            s = tl.load(s_ptr + rows * stride_sn + group).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + rows * stride_zn + group).to(tl.float32)[:, None]
            else:
                z = 1 << (BITS - 1)
        else:  # a group per word: [BLOCK_N, BLOCK_KP], a few distinct ones (L1 hits)
            groups = tl.where(kp_mask, (k0 + offs_kp * PER_INT) // group_size, 0)
            s = tl.load(s_ptr + rows[:, None] * stride_sn + groups[None, :]).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + rows[:, None] * stride_zn + groups[None, :]).to(tl.float32)
            else:
                z = 1 << (BITS - 1)
        part = tl.zeros([BLOCK_N, BLOCK_KP] if ONE_ROW else [BLOCK_M, BLOCK_N], tl.float32)
        for j in tl.static_range(PER_INT):
            w = value_minus_zero(words, j, z, BITS)  # [BLOCK_N, BLOCK_KP], exact
            x = tl.load(x_ptrs + k0 + j, mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_KP]
            if ONE_ROW:
                part += w * x.to(tl.float32)
            elif SCALE_PER_TILE:  # q - zero: small integers, exact in x's dtype
                if IEEE:
                    part = tl.dot(x, tl.trans(w), part, input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(w.to(x.dtype)), part)
            elif IEEE:
                acc = tl.dot(x, tl.trans(w * s), acc, input_precision="ieee")
            else:  # the scaled weight rounded to x's dtype, as the reference rounds it
                acc = tl.dot(x, tl.trans((w * s).to(x.dtype)), acc)
        if ONE_ROW:
            acc2 += part * (s[:, None] if SCALE_PER_TILE else s)
        elif SCALE_PER_TILE:
            acc += part * s[None, :]
    if ONE_ROW:
        acc = tl.reshape(tl.sum(acc2, axis=1), [BLOCK_M, BLOCK_N])
    return acc


@triton.jit
def _tile_ids(M, N, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(pid_m, pid_n) of program_id(0), GROUP_M row tiles walked per column (L2 reuse of W)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit(do_not_specialize=["k_tiles_per_split"])
def _wna16_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [N, K * BITS / 32] int32
    s_ptr,  # [N, G]
    z_ptr,  # [N, G] or dummy
    g_ptr,  # [K] int32 or dummy
    b_ptr,  # [N] or dummy
    out_ptr,  # [M, N]
    ws_ptr,  # SPLIT_K > 1: fp32 [SPLIT_K, M, N]
    count_ptr,  # SPLIT_K > 1: zeroed int32 counters, one per output tile
    M,
    N,
    K,
    group_size,
    k_tiles_per_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    all_ones,  # -1, a run-time value (ROW_AHEAD ties a step's loads with it)
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,
    SCALE_LATER: tl.constexpr,  # dots, SCALE_PER_TILE: dot q - zero (exact), then scale
    HAS_BIAS: tl.constexpr,
    ONE_ROW: tl.constexpr,  # M == 1: multiply-adds, no dot
    PERMUTED_K: tl.constexpr,  # the K loop without interleave (_permuted_k_loop)
    SMALL_MAGIC: tl.constexpr,  # ONE_ROW, PERMUTED_K, 4-bit: _small_magic_k_loop
    IEEE: tl.constexpr,  # fp32 x: an exact fp32 dot (not tf32)
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_VECTOR: tl.constexpr = False,  # SMALL_MAGIC's variants (int_quant_small_magic)
    X_SPLIT: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    K_STAGES: tl.constexpr = 1,  # SMALL_MAGIC's loads pipelined (config key ``k_stages``)
    PACKED_DOT: tl.constexpr = False,  # 4-bit, 16-bit x, dots: _packed_dot_k_loop
    ASM: tl.constexpr = False,  # PACKED_DOT's / QUAD_MMA's PTX (NVIDIA), else plain ops
    QUAD_MMA: tl.constexpr = False,  # one row, 4-bit, 16-bit x: _quad_mma_k_loop
    GROUP_TILES: tl.constexpr = 0,  # QUAD_MMA: K tiles a group where a small power of two
    STEP_TILES: tl.constexpr = 1,  # QUAD_MMA: adjacent K tiles a step
    ROW_MMA: tl.constexpr = False,  # one row, 4-bit, 16-bit x: _row_mma_k_loop
    GROUP_WORDS: tl.constexpr = 4,  # ROW_MMA: words a group
    ROW_SCALE_AFTER: tl.constexpr = False,  # ROW_MMA: the scale after the MMAs
    ROW_XSUM: tl.constexpr = False,  # ROW_MMA: the zero and the scale after the MMAs (bf16)
    ROW_AHEAD: tl.constexpr = False,  # ROW_MMA: a step's weights first, each tile's x at its math
    ROW_WARPS: tl.constexpr = 1,  # ROW_AHEAD: the launch's num_warps
    ROW_STRIDED: tl.constexpr = False,  # ROW_MMA: lane l words l + 32 i (_row_mma_strided_k_loop)
    FRAG: tl.constexpr = False,  # the fragment layout (ops/int_quant_frag.py): interleaved loop
):
    pid_m, pid_n = _tile_ids(M, N, GROUP_M, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Rows past N read row N - 1 (in bounds, discarded at the store): no mask on the W stream.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_lo = tl.program_id(1) * k_tiles_per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + k_tiles_per_split * BLOCK_K)
    if ROW_MMA and ROW_STRIDED:
        acc = _row_mma_strided_k_loop(
            x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, k_lo, k_hi, stride_xm, stride_qn,
            stride_sn, stride_zn, all_ones, HAS_ZEROS, ASM, BLOCK_M, BLOCK_N, GROUP_WORDS,
        )  # fmt: skip
    elif ROW_MMA:
        acc = _row_mma_k_loop(
            x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, k_lo, k_hi, stride_xm, stride_qn,
            stride_sn, stride_zn, HAS_ZEROS, ASM, BLOCK_M, BLOCK_N, GROUP_WORDS, K_STAGES,
            STEP_TILES, ROW_SCALE_AFTER, ROW_XSUM, ROW_AHEAD, all_ones, ROW_WARPS,
        )  # fmt: skip
    elif QUAD_MMA:
        acc = _quad_mma_k_loop(
            x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, k_lo, k_hi, group_size, stride_xm,
            stride_qn, stride_sn, stride_zn, HAS_ZEROS, ASM, BLOCK_M, BLOCK_N, K_STAGES,
            GROUP_TILES, STEP_TILES,
        )  # fmt: skip
    elif PACKED_DOT:
        acc = _packed_dot_k_loop(
            x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size,
            stride_xm, stride_qn, stride_sn, stride_zn, HAS_ZEROS, EVEN_K, ASM, BLOCK_M,
            BLOCK_N, BLOCK_K, X_SPLIT,
        )  # fmt: skip
    elif SMALL_MAGIC:
        acc = _small_magic_k_loop(
            x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size,
            stride_xm, stride_qn, stride_sn, stride_zn, HAS_ZEROS, SCALE_PER_TILE, EVEN_K,
            BLOCK_M, BLOCK_N, BLOCK_K, X_VECTOR, X_SPLIT, PREFETCH, K_STAGES,
        )  # fmt: skip
    elif PERMUTED_K:
        acc = _permuted_k_loop(
            x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size,
            stride_xm, stride_qn, stride_sn, stride_zn, BITS, HAS_ZEROS, SCALE_PER_TILE, ONE_ROW,
            IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    else:
        acc = _interleaved_k_loop(
            x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size,
            stride_xm, stride_qn, stride_sn, stride_zn, BITS, HAS_ZEROS, HAS_G_IDX,
            SCALE_PER_TILE, SCALE_LATER, ONE_ROW, IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, FRAG,
        )  # fmt: skip
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        acc, out_mask = _split_k_sum(acc, ws_ptr, count_ptr, offs_m, offs_n, M, N, SPLIT_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def split_for(tiles: int, k_tiles: int, sms: int, per_sm: int, fill: bool = False) -> int:
    """K splits that bring ``tiles`` output tiles to about ``per_sm`` programs an SM (1 when the
    tiles alone fill the SMs), each split at least two K tiles. ``fill``: split whatever the
    tiles (a program an SM is not enough to cover the memory latency), to the nearest
    ``per_sm`` programs an SM, each split at least FILL_MIN_K_TILES K tiles."""
    if fill:
        return max(1, min(k_tiles // FILL_MIN_K_TILES, round(per_sm * sms / tiles)))
    if tiles >= sms:
        return 1
    return max(1, min(k_tiles // 2, triton.cdiv(per_sm * sms, tiles)))


def _block_k(group_size: int, per_tile: bool, cap: int) -> int:
    """Contiguous groups (``per_tile``): the largest power of two <= cap (>= 32) dividing the
    group size (32 if none does: scales gathered per element); g_idx: cap (gathered anyway)."""
    block = cap
    while per_tile and block > 32 and group_size % block:
        block //= 2
    return block


def _one_row_override(spec: str) -> dict | None:
    """ATOM_WNA16_ONE_ROW="block_n,num_warps,k_stages,per_sm[,mode]": the one-row 4-bit
    launch (X_VECTOR multiply-adds, or with ``quad`` the quads' MMAs where they fit: QUAD_MMA,
    ``quadN`` N = 1, 2, 4, 8 K tiles a step: QUAD_STEP; ``row`` a warp a row: ROW_MMA, ``rowN``
    N tiles a step: ROW_STEP), K split to about per_sm programs an SM whatever the N tiles,
    loads pipelined k_stages - 1 tiles ahead, for an A/B in the engine."""
    if not spec:
        return None
    fields = spec.split(",")
    quad = len(fields) == 5 and re.fullmatch(r"quad[1248]?", fields[4]) is not None
    step = int(fields[4][4:] or 1) if quad else 1
    row = len(fields) == 5 and re.fullmatch(r"row[1248]?", fields[4]) is not None
    if row:
        step = int(fields[4][3:] or 1)
    try:
        if quad or row:
            fields = fields[:4]
        block_n, num_warps, k_stages, per_sm = (int(f) for f in fields)
        if min(block_n, num_warps, k_stages, per_sm) < 1 or any(
            v & (v - 1) for v in (block_n, num_warps)
        ):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"ATOM_WNA16_ONE_ROW={spec!r}: expected "
            "'block_n,num_warps,k_stages,per_sm[,mode]' (positive integers, block_n and num_warps "
            "powers of two; mode quad or row, each optionally followed by 1, 2, 4 or 8)"
        ) from None
    if (quad and block_n % (8 * num_warps)) or (row and block_n % num_warps):
        raise ValueError(
            f"ATOM_WNA16_ONE_ROW={spec!r}: block_n must be a multiple of "
            f"{'8 * ' if quad else ''}num_warps for mode {spec.split(',')[4]}"
        )
    out = dict(BLOCK_N=block_n, num_warps=num_warps, k_stages=k_stages, per_sm=per_sm, fill=True)
    if row:
        return dict(out, ROW_MMA=True, BLOCK_K=ROW_BLOCK_K, ROW_STEP=step)
    return dict(out, QUAD_MMA=True, QUAD_STEP=step) if quad else out


ONE_ROW_OVERRIDE = _one_row_override(envs.ATOM_WNA16_ONE_ROW)


def _one_row_config(k: int, group_size: int, bits: int, quad: bool, row_scales: bool,
                    mma: str | None, override: dict | None) -> dict:  # fmt: skip
    """The one-row launch (``wna16_config``'s docstring): ``mma`` None takes the MMAs a warp a
    row where they fit, else the quads' where they fit, else the multiply-adds; "row" / "quad"
    only that loop (an explicit config naming it), "" the multiply-adds. ATOM_WNA16_ONE_ROW
    (``override``, not under an explicit config) applies to the loop its mode names where that
    loop is taken; where it is not (it does not fit), the default chain runs without it."""
    mode = None
    if override is not None:
        mode = "row" if override.get("ROW_MMA") else "quad" if override.get("QUAD_MMA") else ""
    wanted = mma if mma is not None else mode
    fits_row = (quad and bits == 4 and group_size % 32 == 0 and k % ROW_BLOCK_K == 0
                and row_scales)  # fmt: skip
    fits_quad = (quad and bits == 4 and group_size % QUAD_BLOCK_K == 0
                 and k % (QUAD_DEFAULT_STEP * QUAD_BLOCK_K) == 0)  # fmt: skip
    if wanted in (None, "row") and (fits_row or mma == "row"):
        cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=ROW_BLOCK_K, num_warps=4, num_stages=1,
                   GROUP_M=1, k_stages=1, per_sm=8, fill=True, ROW_MMA=True)  # fmt: skip
        taken = "row"
    elif wanted in (None, "row", "quad") and mma != "" and (fits_quad or mma == "quad"):
        cfg = dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=QUAD_BLOCK_K, num_warps=4, num_stages=1,
                   GROUP_M=1, k_stages=2, per_sm=8, fill=True, QUAD_MMA=True,
                   QUAD_STEP=QUAD_DEFAULT_STEP)  # fmt: skip
        taken = "quad"
    else:
        cfg = dict(BLOCK_M=1, BLOCK_N=256, BLOCK_K=128, num_warps=4, num_stages=1, GROUP_M=1,
                   per_sm=2, SMALL_MAGIC=bits == 4, X_VECTOR=bits == 4)  # fmt: skip
        taken = "" if bits == 4 else None
    if override is not None and mode == taken:
        cfg.update(override)
    return cfg


def wna16_config(num_rows: int, n: int, k: int, group_size: int, per_tile: bool, sms: int,
                 interpreted: bool = False, bits: int = 4, packed_dot: bool = False,
                 override: bool = True, quad: bool = False, row_scales: bool = True,
                 mma: str | None = None) -> dict:  # fmt: skip
    """The launch of ``_wna16_kernel`` for an [num_rows, k] x [n, k]^T GEMM (``per_tile``: the
    groups are contiguous, no g_idx); ``PERMUTED_K``: the K loop without interleave.

    Decode takes the permuted K loop (``_permuted_k_loop``) where a word lies in one group (no
    g_idx, group_size a multiple of 32 / bits) at up to PERMUTED_MAX_ROWS rows: the interleaved
    loop's [BLOCK_N, BLOCK_KP, 8] -> [BLOCK_N, BLOCK_K] reshape costs layout conversions through
    shared memory. One row: the permuted multiply-adds (BLOCK_M = 1) over 256-wide tiles; 2..4
    rows: the permuted 16-row dots (128-deep K tiles: a dot's K is BLOCK_K * bits / 32 >= 16);
    5..16 rows: the interleaved 16-row dots.
    NOTE (one H100, 2026-11-28, benchmarks/results/int-quant/s19/int-h100.json, cold-L2 graphs,
    alternatives in one call; us for qkv / o / gate_up / down of Llama-3-8B): one row,
    interleaved dots 22.2 / 14.3 / 74.9 / 39.6, permuted dots 16.3 / 11.0 / 51.2 / 30.4,
    permuted multiply-adds 64-wide 13.8 / 10.0 / 49.1 / 27.5, and 256-wide (the tile sweep's best
    of 33 launches at every shape) 12.5 / 9.7 / 42.7 / 24.8 (34-47% of the copy bandwidth: the
    70% target is not met); 4 rows, permuted dots 17.3 / 11.8 / 54.1 / 31.6 against interleaved
    22.2 / 14.1 / 74.8 / 39.6; 16 rows, permuted dots 29.9 / 19.1 / 105.1 / 58.2 against
    interleaved 22.7 / 14.7 / 75.2 / 40.0. 8 rows: not measured (interleaved).
    Instructions a weight (sm_90 SASS of the main loop, 4-bit, counts, not times): interleaved
    -> permuted: 16-row dots 64 x 128 tiles 8.5 -> 6.4, BLOCK_M = 1 multiply-adds 10.3 -> 6.4
    (256-wide 4.9); at 70% of an H200's copy rate its SMs can issue ~5.6 a weight.
    One row, 4-bit: the multiply-adds without a subtraction a weight (``SMALL_MAGIC``,
    ``int_quant_small_magic``) reading x as 64-bit words (``X_VECTOR``).
    NOTE (one H200, 2026-11-28, benchmarks/results/int-quant/s23/int-m1-h200.json, CUDA graphs
    back to back, alternatives in one call; us for qkv / o / gate_up / down): the permuted
    multiply-adds above 9.41 / 7.58 / 36.30 / 17.68, SMALL_MAGIC 8.26 / 6.93 / 30.78 / 14.80,
    with X_VECTOR 7.58 / 6.49 / 29.37 / 13.57 (X_SPLIT, PREFETCH and both with X_VECTOR slower);
    bf16 ``linear`` 14.45 / 10.39 / 56.54 / 32.09.
    2..16 rows, 4-bit, 16-bit x, groups of a multiple of 128 (``packed_dot``: the launcher's
    ATOM_WNA16_PACKED_DOT, not on ROCm): the packed-unpack dots (``int_quant_packed_dot``), K split
    to about 4 programs an SM whatever the N tiles (``fill``: one or two programs an SM leave the
    memory latency uncovered: ncu on the one-row launches, 11-15% achieved occupancy, stalls
    mostly long-scoreboard), x as one split load (``X_SPLIT``) from PACKED_DOT_X_SPLIT_FROM rows
    (int_quant_packed_dot's NOTE).
    NOTE (one H200, 2026-12-01, benchmarks/results/int-quant/s25/, cold-L2 graphs, alternatives
    in one call; us for qkv / o / gate_up / down): 4 rows, the permuted dots 21.0 / 15.3 / 56.8 /
    41.5, the packed dots (128 x 128 tiles, 4 stages) 15.6 / 13.2 / 55.1 / 33.8, with ``fill``
    15.3 / 13.1 / 47.6 / 30.0; 16 rows, the interleaved dots 23.8 / 16.1 / 76.1 / 42.9 (s25
    int-packed-dot.json), packed with ``fill`` 20.8 / 17.2 / 68.2 / 40.8. One row keeps the
    multiply-adds: the packed dots (best launch 14.6 / 12.1 / 40.5 / 27.4) lose to X_VECTOR
    (11.4 / 9.4 / 36.2 / 22.2), with X_SPLIT (no x barrier in the loop) too (14.3 / 11.6 / 40.8
    / 26.0 against 11.4 / 9.3 / 34.8 / 22.0, x-split/int-x-split.json): at one row what bounds
    both is the bytes in flight (ncu above), not the loop's instructions.
    NOTE (one H200, 2026-12-02, benchmarks/results/int-quant/s27/int-k-stages.json, cold L2, us
    for qkv / o / gate_up / down): the loads pipelined into shared memory (``k_stages`` 2-4,
    cp.async: bytes in flight without registers) at 9 launches, best 11.0 / 9.2 / 34.2 / 19.8,
    against the default's 11.7 / 9.0 / 34.9 / 22.2 and the X_VECTOR 128-wide tiles' 10.7 / 8.8 /
    48.7 / 20.1: no shape gains past the other launches (at most 2-8%, within the spread of the
    candidates); the engine's decode step (Llama-3-8B W4A16, batch 1) 2.79 ms by default, 2.98 /
    2.86 ms with ATOM_WNA16_ONE_ROW=256,4,3,1 / 128,4,3,2. Kept as a launch option, not the
    default.
    One row, 4-bit, 16-bit x on NVIDIA (``quad``: the launcher's ATOM_WNA16_QUAD): with scales
    of x's dtype (``row_scales``), groups of a multiple of 32 and K of 1024, the MMAs a warp a
    row (``int_quant_row_mma``), 8 rows a program, 4 warps, K split to about 8 programs an SM;
    else with groups of a multiple of 128 and K of 256 the quads' MMAs (``int_quant_quad_mma``),
    64 rows a program, 4 warps, two adjacent K tiles a step (``QUAD_STEP``), loads one step
    ahead (``k_stages`` 2), K split to about 8 programs an SM.
    NOTE (one H200, 2026-12-02, benchmarks/results/int-quant/s28/, cold L2, us for qkv / o /
    gate_up / down): one tile a step the MMAs alone gain little (best 11.1 / 8.8 / 35.7 / 19.6
    against X_VECTOR's 11.5 / 9.4 / 36.4 / 22.1; ncu on gate_up: 40% of DRAM either way, 20%
    occupancy): not the instructions; two tiles a step (128 contiguous bytes of each row
    requested at once) 10.9 / 9.1 / 29.3 / 19.2; X_VECTOR with 256 / 512-deep tiles (more bytes
    a row too, but scales gathered a word) 25.6-32.9 at down. bf16 ``linear`` 20.3 / 16.6 /
    68.2 / 40.1. The engine's decode step (Llama-3-8B W4A16, batch 1, decode_ab, two rounds)
    2.84 ms X_VECTOR, 2.67 ms with this launch (bf16 4.39 ms: 1.64x).
    NOTE (the same day, results/int-quant/s28/int-row.json, 12 launches of the MMAs a warp a row:
    each warp load one row's 512 contiguous bytes): best (8 rows, 4 warps, no cp.async, fill 8)
    8.8 / 7.7 / 29.7 / 17.5 against the quads' 10.7 / 8.9 / 29.4 / 18.5; loads pipelined
    (k_stages 2, 3) slower at every shape (26-36% of the copy roofline at gate_up); the engine
    step 2.56 ms against the quads' 2.67 (1.71x the bf16 step's 4.39 ms; the 2x target missed:
    ncu on gate_up 35% of DRAM, 45% occupancy, stalls long- and short-scoreboard). Every load
    of 2 or 4 tiles before their math (``ROW_STEP``, int-row-step-call6.json) slower at every
    shape and tile (sum of the four 73.6-73.7 us against one tile a step's 64.3 us): kept an
    option. The same call: this default 8.6 / 7.5 / 30.2 / 18.0 us, the engine step 2.56 ms
    against 2.80 ms with ATOM_WNA16_QUAD=0."""
    per_int = 32 // bits
    permuted = num_rows <= PERMUTED_MAX_ROWS and per_tile and group_size % per_int == 0
    packed_dot = (packed_dot and bits == 4 and per_tile
                  and PACKED_DOT_MIN_ROWS <= num_rows <= PACKED_DOT_MAX_ROWS
                  and group_size % 128 == 0 and not interpreted)  # fmt: skip
    if packed_dot:
        cfg = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4, GROUP_M=1,
                   per_sm=4, fill=True, PACKED_DOT=True,
                   X_SPLIT=num_rows >= PACKED_DOT_X_SPLIT_FROM)  # fmt: skip
        permuted = True
    elif interpreted:
        cfg = dict(BLOCK_M=1 if num_rows == 1 else 16, BLOCK_N=16, BLOCK_K=32, num_warps=4,
                   num_stages=1, GROUP_M=1, per_sm=2)  # fmt: skip
    elif num_rows == 1 and permuted:
        cfg = _one_row_config(k, group_size, bits, quad, row_scales, mma,
                              ONE_ROW_OVERRIDE if override else None)  # fmt: skip
        permuted = True
    elif num_rows <= SKINNY_MAX_ROWS:
        block_k = 128 if permuted else _block_k(group_size, per_tile, 128)
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=4, GROUP_M=1,
                   per_sm=2)  # fmt: skip
    else:
        block_m = 64 if num_rows <= 64 else 128
        warps = 8 if block_m == 128 else 4
        cfg = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=_block_k(group_size, per_tile, 64),
                   num_warps=warps, num_stages=3, GROUP_M=8, per_sm=1)  # fmt: skip
    cfg["PERMUTED_K"] = permuted
    tiles = triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    cfg["SPLIT_K"] = split_for(tiles, triton.cdiv(k, cfg["BLOCK_K"]), sms, cfg["per_sm"],
                               cfg.get("fill", False))  # fmt: skip
    return cfg


def _launch_split(device, tiles: int, k: int, cfg: dict, multiple: int = 1):
    """(splits, K tiles a split (a multiple of ``multiple``), counters or None): as linear.py,
    no split (counters None) when the counters would have to grow inside a graph capture."""
    k_tiles = max(1, triton.cdiv(k, cfg["BLOCK_K"]))
    per_split = triton.cdiv(k_tiles, max(1, cfg["SPLIT_K"]))
    per_split = triton.cdiv(per_split, multiple) * multiple
    splits = triton.cdiv(k_tiles, per_split)
    counters = zeroed_counters(device, tiles) if splits > 1 else None
    if counters is None:
        return 1, k_tiles, None
    return splits, per_split, counters


def _packed_dot_for(cfg: dict, override: dict, dtype: torch.dtype, bits: int, per_tile: bool,
                    group_size: int) -> bool:  # fmt: skip
    """Whether the launch takes ``_packed_dot_k_loop``: asked for (``PACKED_DOT``) and it fits
    (4-bit weights, bf16 / fp16 x, 16-row dots, BLOCK_K dividing the group size, no g_idx, dots
    at least MIN_DOT_K words deep); a default's that does not fit is dropped, an override's
    raises."""
    if not cfg.get("PACKED_DOT", False):
        return False
    block_k = cfg["BLOCK_K"]
    why = []
    if bits != 4 or dtype not in PACKED_DOT_DTYPES:
        why.append(f"4-bit weights and bf16 / fp16 x (got {bits}-bit, {dtype})")
    if cfg["BLOCK_M"] != 16:
        why.append(f"BLOCK_M 16 (got {cfg['BLOCK_M']})")
    if not per_tile or group_size % block_k:
        why.append(f"no g_idx and BLOCK_K dividing the group size (BLOCK_K {block_k}, group "
                   f"{group_size})")  # fmt: skip
    if block_k // 8 < MIN_DOT_K:
        why.append(f"BLOCK_K >= {MIN_DOT_K * 8} (got {block_k})")
    if not why:
        return True
    if override.get("PACKED_DOT"):
        raise ValueError("wna16_linear: PACKED_DOT needs " + "; ".join(why))
    return False


def _quad_mma_for(cfg: dict, override: dict, x2: torch.Tensor, qweight: torch.Tensor, bits: int,
                  per_tile: bool, group_size: int, k: int) -> bool:  # fmt: skip
    """Whether the launch takes ``_quad_mma_k_loop``: asked for (``QUAD_MMA``) and it fits (one
    row, 4-bit weights, bf16 / fp16 x, no g_idx, K and the group size multiples of 128, BLOCK_K
    128, BLOCK_N a multiple of 8 * num_warps, the words 16-byte aligned: the layout its PTX
    relies on); a default's that does not fit is dropped, an override's raises."""
    if not cfg.get("QUAD_MMA", False):
        return False
    why = _one_row_why(cfg, x2)
    if bits != 4 or x2.dtype not in PACKED_DOT_DTYPES:
        why.append(f"4-bit weights and bf16 / fp16 x (got {bits}-bit, {x2.dtype})")
    if not per_tile or group_size % QUAD_BLOCK_K or k % QUAD_BLOCK_K:
        why.append(f"no g_idx, K and the group size multiples of {QUAD_BLOCK_K} (K {k}, group "
                   f"{group_size})")  # fmt: skip
    if cfg["BLOCK_K"] != QUAD_BLOCK_K or cfg["BLOCK_N"] % (8 * cfg["num_warps"]):
        why.append(f"BLOCK_K {QUAD_BLOCK_K} and BLOCK_N a multiple of 8 * num_warps (got "
                   f"{cfg['BLOCK_K']}, {cfg['BLOCK_N']}, {cfg['num_warps']} warps)")  # fmt: skip
    return _mma_fits("QUAD_MMA", why + _layout_why(x2, qweight), override)


def _one_row_why(cfg: dict, x2: torch.Tensor) -> list[str]:
    """The MMA loops' first need, unmet: one row at BLOCK_M 1."""
    if x2.shape[0] != 1 or cfg["BLOCK_M"] != 1:
        return [f"one row and BLOCK_M 1 (got {x2.shape[0]} rows, BLOCK_M {cfg['BLOCK_M']})"]
    return []


def _layout_why(x2: torch.Tensor, qweight: torch.Tensor) -> list[str]:
    """The MMA loops' last needs, unmet: the words' rows aligned, a device they run on."""
    why = []
    if not _aligned_rows(qweight):
        why.append("16-byte aligned words and rows (a row stride of a multiple of 16 words)")
    if not _mma_device(x2):
        why.append(f"an NVIDIA GPU or Triton's interpreter (got {x2.device})")
    return why


def _mma_fits(key: str, why: list[str], override: dict) -> bool:
    """True without unmet needs; else False for a default's loop, a ValueError naming them for
    an explicit config's."""
    if not why:
        return True
    if override.get(key):
        raise ValueError(f"wna16_linear: {key} needs " + "; ".join(why))
    return False


def _aligned_rows(qweight: torch.Tensor) -> bool:
    """Whether Triton sees ``qweight``'s rows 16-byte aligned (its pointer and row stride
    multiples of 16: the 16-byte loads the MMA loops' layouts come from)."""
    return qweight.data_ptr() % 16 == 0 and qweight.stride(0) % 16 == 0


def _mma_device(x: torch.Tensor) -> bool:
    """Whether the MMA loops run here: their PTX on an NVIDIA GPU, their emulation under the
    interpreter (another GPU would compile the emulation: untested, slow)."""
    if is_interpreted(x.device):
        return True
    return x.device.type == "cuda" and not torch.version.hip


def _row_mma_for(cfg: dict, override: dict, x2: torch.Tensor, qweight: torch.Tensor,
                 scales: torch.Tensor, bits: int, per_tile: bool, group_size: int,
                 k: int) -> bool:  # fmt: skip
    """Whether the launch takes ``_row_mma_k_loop``: asked for (``ROW_MMA``) and it fits (one
    row, 4-bit weights, bf16 / fp16 x and scales of its dtype, no g_idx, K a multiple of 1024,
    groups of a multiple of 32, BLOCK_K 1024, BLOCK_N a multiple of num_warps, the words 16-byte
    aligned: the layout its PTX relies on); a default's that does not fit is dropped, an
    override's raises."""
    if not cfg.get("ROW_MMA", False):
        return False
    why = _one_row_why(cfg, x2)
    if bits != 4 or x2.dtype not in PACKED_DOT_DTYPES or scales.dtype != x2.dtype:
        why.append(f"4-bit weights, bf16 / fp16 x and scales of its dtype (got {bits}-bit, "
                   f"{x2.dtype}, {scales.dtype} scales)")  # fmt: skip
    if not per_tile or group_size % 32 or k % ROW_BLOCK_K:
        why.append(f"no g_idx, K a multiple of {ROW_BLOCK_K} and groups of 32 (K {k}, group "
                   f"{group_size})")  # fmt: skip
    if cfg["BLOCK_K"] != ROW_BLOCK_K or cfg["BLOCK_N"] % cfg["num_warps"]:
        why.append(f"BLOCK_K {ROW_BLOCK_K} and BLOCK_N a multiple of num_warps (got "
                   f"{cfg['BLOCK_K']}, {cfg['BLOCK_N']}, {cfg['num_warps']} warps)")  # fmt: skip
    return _mma_fits("ROW_MMA", why + _layout_why(x2, qweight), override)


def _row_scale_after(cfg: dict, override: dict, group_size: int, row: bool) -> bool:
    """Whether ROW_MMA (``row``: the launch takes it) scales after its MMAs: asked for (the
    config's ``ROW_SCALE_AFTER``, else ATOM_WNA16_ROW_SCALE_AFTER) and the groups multiples of
    128 values (a chunk of the MMA one group); the switch's where it cannot is dropped, an
    explicit config's raises."""
    asked = bool(cfg.get("ROW_SCALE_AFTER", ROW_SCALE_AFTER_ENABLED))
    why = [] if row else ["ROW_MMA"]
    if group_size % 128:
        why.append(f"groups of a multiple of 128 (got {group_size})")
    if asked and why and override.get("ROW_SCALE_AFTER"):
        raise ValueError(f"wna16_linear: ROW_SCALE_AFTER needs {' and '.join(why)}")
    return asked and not why


def _row_xsum_ahead(cfg: dict, override: dict, group_size: int, row: bool,
                    dtype) -> tuple[bool, bool]:  # fmt: skip
    """(ROW_XSUM, ROW_AHEAD) of a ROW_MMA launch (``row``): each asked for by the config's key,
    else ATOM_WNA16_ROW_XSUM / ATOM_WNA16_ROW_AHEAD; XSUM needs bf16 x and groups of a multiple
    of 128 values, AHEAD one stage. The switch's where it cannot run is
    dropped, an explicit config's raises."""
    out = []
    for key, default, needs in (
        ("ROW_XSUM", ROW_XSUM_ENABLED, [
            *([] if dtype == torch.bfloat16 else [f"bf16 x (got {dtype})"]),
            *([] if group_size % 128 == 0 else [f"groups of a multiple of 128 (got {group_size})"]),
        ]),
        ("ROW_AHEAD", ROW_AHEAD_ENABLED, [
            *([] if cfg.get("k_stages", 1) == 1 else [f"k_stages 1 (got {cfg['k_stages']})"]),
        ]),
    ):  # fmt: skip
        asked = bool(cfg.get(key, default))
        why = ([] if row else ["ROW_MMA"]) + needs
        if asked and why and override.get(key):
            raise ValueError(f"wna16_linear: {key} needs {' and '.join(why)}")
        out.append(asked and not why)
    return out[0], out[1]


def _row_strided(cfg: dict, override: dict, row: bool, step: int, keys: dict) -> bool:
    """Whether ROW_MMA (``row``) takes ``_row_mma_strided_k_loop``: asked for (the config's
    ``ROW_STRIDED``, else ATOM_WNA16_ROW_STRIDED), with one tile a step, one stage and none of
    ``keys`` (the other loops' variants, name -> on) on; the switch's is dropped where it
    cannot run, an explicit config's raises."""
    asked = bool(cfg.get("ROW_STRIDED", ROW_STRIDED_ENABLED))
    why = [] if row else ["ROW_MMA"]
    if step != 1 or cfg.get("k_stages", 1) != 1:
        why.append(f"one tile a step and k_stages 1 (got {step}, {cfg.get('k_stages', 1)})")
    why += [f"no {name}" for name, on in keys.items() if on]
    if asked and why and override.get("ROW_STRIDED"):
        raise ValueError(f"wna16_linear: ROW_STRIDED needs {' and '.join(why)}")
    return asked and not why


def _group_tiles(group_size: int) -> int:
    """QUAD_MMA's K tiles a group as a constant divisor (1, 2, 4 or 8), else 0 (divided at run
    time: channel-wise scales, large groups)."""
    tiles = group_size // QUAD_BLOCK_K
    return tiles if tiles in (1, 2, 4, 8) else 0


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def wna16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    bias: torch.Tensor | None,
    config: dict | None = None,
) -> torch.Tensor:
    """See ``atom_kernels.wna16_linear``; ``config`` (keys of ``wna16_config``; SPLIT_K None:
    chosen; ``SMALL_MAGIC``: ``_small_magic_k_loop``, one row, permuted, 4-bit) overrides the
    launch (benchmarks, tests). A weight in the fragment layout (``ops/int_quant_frag.py``)
    takes ``int_quant_frag`` at 1-8 rows of 16-bit x, else the interleaved loop reading that
    layout (``FRAG``; a config's ``FRAG_TILED`` asks for it at any rows)."""
    frag = is_frag(qweight)
    if frag and frag_usable(x) and not (config or {}).get("FRAG_TILED"):
        return wna16_frag_linear(x, qweight, scales, zeros, bias, config)
    if config and "FRAG_TILED" in config:
        config = {key: v for key, v in config.items() if key != "FRAG_TILED"} or None
    n, k = frag_shape(qweight, bits)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    x2 = _contiguous(as_rows(x))
    qweight, scales, zeros, g_idx, bias = map(_contiguous, (qweight, scales, zeros, g_idx, bias))
    num_rows = x2.shape[0]
    group_size = k // scales.shape[1]
    per_tile = g_idx is None
    sms = num_sms(x.device)
    # an override without PACKED_DOT starts from the other loops' default (what it varies)
    packed = (PACKED_DOT_ENABLED and x.dtype in PACKED_DOT_DTYPES and not torch.version.hip
              and (not config or "PACKED_DOT" in config) and not frag)  # fmt: skip
    # The one-row MMAs by default where they can run (16-bit x on NVIDIA, the words in 16-byte
    # aligned rows: the layout their PTX relies on); an explicit config takes the loop it names
    # (ROW_MMA, else QUAD_MMA, else the multiply-adds) and none of the others' keys.
    quad = (QUAD_ENABLED and num_rows == 1 and x.dtype in PACKED_DOT_DTYPES
            and _mma_device(x) and _aligned_rows(qweight) and not frag)  # fmt: skip
    mma = None
    if config:
        mma = "row" if config.get("ROW_MMA") else "quad" if config.get("QUAD_MMA") else ""
    cfg = wna16_config(num_rows, n, k, group_size, per_tile, sms, is_interpreted(x.device), bits,
                       packed, override=not config, quad=quad,
                       row_scales=scales.dtype == x.dtype, mma=mma)  # fmt: skip
    cfg.update(config or {})
    if frag:  # the fragment layout: only the interleaved loop reads it
        cfg.update(PERMUTED_K=False, PACKED_DOT=False, QUAD_MMA=False, ROW_MMA=False,
                   SMALL_MAGIC=False)  # fmt: skip
    block_k = cfg["BLOCK_K"]
    one_row = cfg["BLOCK_M"] == 1
    if num_rows > 1 and one_row:
        raise ValueError("wna16_linear: BLOCK_M = 1 (multiply-adds) takes one row only")
    permuted = bool(cfg.get("PERMUTED_K", False))
    if permuted and not (per_tile and group_size % (32 // bits) == 0):
        raise ValueError(
            "wna16_linear: PERMUTED_K needs no g_idx and whole words in a group "
            f"(group size {group_size}, {bits}-bit)"
        )
    if permuted and not one_row and block_k // (32 // bits) < MIN_DOT_K:
        # Its dots are BLOCK_K / (32 / bits) deep; a GPU's tl.dot takes 16 or more.
        if (config or {}).get("PERMUTED_K"):
            raise ValueError(
                f"wna16_linear: PERMUTED_K with dots needs BLOCK_K >= {MIN_DOT_K * 32 // bits} "
                f"at {bits} bits (got {block_k})"
            )
        permuted = False  # an override's shallower K tile: the interleaved loop
    small_magic = bool(cfg.get("SMALL_MAGIC", False))
    fits = one_row and permuted and bits == 4
    if small_magic and not fits and not (config or {}).get("SMALL_MAGIC"):
        small_magic = False  # the default's, under an override's other loop
    if small_magic and not fits:
        raise ValueError(
            "wna16_linear: SMALL_MAGIC is a variant of the one-row permuted multiply-adds: it "
            f"needs BLOCK_M = 1, PERMUTED_K and 4-bit weights (got BLOCK_M {cfg['BLOCK_M']}, "
            f"PERMUTED_K {permuted}, {bits}-bit)"
        )
    packed_dot = _packed_dot_for(cfg, config or {}, x.dtype, bits, per_tile, group_size)
    if packed_dot:
        small_magic = False
    variants = {key: bool(cfg.get(key, False)) for key in SMALL_MAGIC_VARIANTS}
    if not small_magic and not any((config or {}).get(key) for key in variants):
        variants = dict.fromkeys(variants, False)  # the default's, under another loop
    if packed_dot:  # X_SPLIT is the packed dots' variant too (int_quant_packed_dot)
        variants = dict.fromkeys(variants, False) | {"X_SPLIT": bool(cfg.get("X_SPLIT", False))}
    elif any(variants.values()) and not small_magic:
        raise ValueError(
            f"wna16_linear: {', '.join(k for k, v in variants.items() if v)} are variants of "
            "SMALL_MAGIC's loop: they need SMALL_MAGIC"
        )
    row = _row_mma_for(cfg, config or {}, x2, qweight, scales, bits, per_tile, group_size, k)
    quad = not row and _quad_mma_for(cfg, config or {}, x2, qweight, bits, per_tile,
                                     group_size, k)  # fmt: skip
    if quad or row:
        small_magic = packed_dot = False
        variants = dict.fromkeys(variants, False)
    if (variants["X_VECTOR"] or quad or row) and x2.data_ptr() % 16:  # x as 64-bit words
        x2 = x2.clone()
    tiles = triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if cfg["SPLIT_K"] is None:  # an override's "choose"
        cfg["SPLIT_K"] = split_for(tiles, triton.cdiv(k, block_k), sms, cfg.get("per_sm", 2),
                                   cfg.get("fill", False))  # fmt: skip
    step = int(cfg.get("QUAD_STEP", 1)) if quad else 1
    if step not in (1, 2, 4, 8) or k % (step * QUAD_BLOCK_K):
        if (config or {}).get("QUAD_STEP", 1) != 1:
            raise ValueError(f"wna16_linear: QUAD_STEP {step} needs 1, 2, 4 or 8 and K a "
                             f"multiple of {step * QUAD_BLOCK_K} (got {k})")  # fmt: skip
        step = 1
    if row:  # ROW_STEP: tiles a step at most (the largest power of two dividing K's tiles)
        step = int(cfg.get("ROW_STEP", 1))
        if step not in (1, 2, 4, 8):
            raise ValueError(f"wna16_linear: ROW_STEP {step} needs 1, 2, 4 or 8")
        while k % (step * ROW_BLOCK_K):
            step //= 2
    scale_after = _row_scale_after(cfg, config or {}, group_size, row)
    xsum, ahead = _row_xsum_ahead(cfg, config or {}, group_size, row, x.dtype)
    scale_after = scale_after and not xsum  # XSUM scales after its MMAs too
    strided = _row_strided(cfg, config or {}, row, step, dict(
        ROW_SCALE_AFTER=scale_after, ROW_XSUM=xsum, ROW_AHEAD=ahead))  # fmt: skip
    splits, per_split, counters = _launch_split(x.device, tiles, k, cfg, step)
    scale_per_tile = per_tile and group_size % block_k == 0
    # Decode tiles dot q - zero and scale each tile's result (no multiply a weight); prefill tiles
    # scale the weight instead, so the MMAs chain on one accumulator (Hopper's async wgmma).
    scale_later = scale_per_tile and 1 < cfg["BLOCK_M"] <= SKINNY_MAX_ROWS
    out2 = out.view(-1, n)
    ws = x2.new_empty((splits, num_rows, n), dtype=torch.float32) if splits > 1 else out2
    _wna16_kernel[(tiles, splits)](
        x2, qweight, scales, zeros if zeros is not None else scales,
        g_idx if g_idx is not None else qweight, bias if bias is not None else out2, out2, ws,
        counters if counters is not None else qweight, num_rows, n, k, group_size, per_split,
        x2.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out2.stride(0), -1,
        FRAG=frag,
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        SCALE_PER_TILE=scale_per_tile, SCALE_LATER=scale_later,
        HAS_BIAS=bias is not None,
        ONE_ROW=one_row, PERMUTED_K=permuted, SMALL_MAGIC=small_magic,
        IEEE=x.dtype == torch.float32,
        PACKED_DOT=packed_dot, QUAD_MMA=quad, GROUP_TILES=_group_tiles(group_size) if quad else 0,
        STEP_TILES=step, ROW_MMA=row, GROUP_WORDS=group_size // 8 if row else 4,
        ROW_SCALE_AFTER=scale_after, ROW_XSUM=xsum, ROW_AHEAD=ahead,
        ROW_WARPS=cfg["num_warps"] if ahead else 1, ROW_STRIDED=strided,
        ASM=(packed_dot or quad or row) and x.device.type == "cuda" and not torch.version.hip,
        EVEN_K=k % block_k == 0,
        SPLIT_K=splits, GROUP_M=cfg["GROUP_M"], BLOCK_M=max(cfg["BLOCK_M"], 1),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        K_STAGES=cfg.get("k_stages", 1) if small_magic or quad or row else 1,
        **variants,
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )  # fmt: skip
    return out


@triton.jit
def _dequant_wna16_kernel(
    q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, group_size, stride_qn, stride_sn, stride_zn,
    stride_on, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FRAG: tl.constexpr = False,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w, _ = _dequant_tile(
        q_ptr, s_ptr, z_ptr, g_ptr, rows, k0, K, group_size, stride_qn, stride_sn, stride_zn,
        BITS, HAS_ZEROS, HAS_G_IDX, SCALE_PER_TILE, EVEN_K, BLOCK_N, BLOCK_K, False, FRAG,
    )  # fmt: skip
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    out_ptrs = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_wna16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """See ``atom_kernels.dequantize_wna16``: the float weight [N, K] in ``dtype``."""
    n, k = frag_shape(qweight, bits)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if out.numel() == 0:
        return out
    qweight, scales, zeros, g_idx = map(_contiguous, (qweight, scales, zeros, g_idx))
    group_size = k // scales.shape[1]
    block_n, block_k = (16, 32) if is_interpreted(qweight.device) else (32, 128)
    block_k = _block_k(group_size, g_idx is None, block_k)
    _dequant_wna16_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros if zeros is not None else scales,
        g_idx if g_idx is not None else qweight, out, n, k, group_size, qweight.stride(0),
        scales.stride(0), zeros.stride(0) if zeros is not None else 0, out.stride(0),
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        SCALE_PER_TILE=g_idx is None and group_size % block_k == 0, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, FRAG=is_frag(qweight),
    )  # fmt: skip
    return out


# --- W8A8 -----------------------------------------------------------------------------------------


@triton.jit
def _int8_quant_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] int8 out
    s_ptr,  # [M] fp32 out: each row's scale
    in_scale_ptr,  # STATIC: the one-element per-tensor scale
    K,
    stride_xm,
    stride_qm,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row): scale = max(max|x|, 1e-10) / 127 (or the static scale), q = clamp(round(x /
    scale), -128, 127), IEEE divisions (torch's), round half to even."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(in_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, K, BLOCK):
            x = tl.load(x_row + c + offs, mask=c + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-10), 127.0)
    tl.store(s_ptr + row, scale)
    for c in range(0, K, BLOCK):
        mask = c + offs < K
        x = tl.load(x_row + c + offs, mask=mask, other=0.0).to(tl.float32)
        # clamping first, then rounding, is round-then-clamp (the bounds are integers) and keeps
        # |y| < 2**22 for the rounding trick
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -128.0), 127.0)
        y = (y + ROUND_MAGIC) - ROUND_MAGIC
        tl.store(q_ptr + row * stride_qm + c + offs, y.to(tl.int8), mask=mask)


def quantize_int8(x: torch.Tensor, input_scale: torch.Tensor | None):
    """x [M, K] -> (int8 [M, K], float32 row scales [M]): ``quantize_int8_per_token`` of the torch
    reference, bit for bit."""
    num_rows, k = x.shape
    x = _contiguous(x)
    q = torch.empty((num_rows, k), dtype=torch.int8, device=x.device)
    scales = torch.empty((num_rows,), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scales
    block = min(triton.next_power_of_2(max(k, 16)), 256 if is_interpreted(x.device) else 4096)
    _int8_quant_kernel[(num_rows,)](
        x, q, scales, input_scale if input_scale is not None else scales, k, x.stride(0),
        q.stride(0), STATIC=input_scale is not None, BLOCK=block,
        num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1,
    )  # fmt: skip
    return q, scales


@triton.jit(do_not_specialize=["k_tiles_per_split"])
def _int8_gemm_kernel(
    a_ptr,  # [M, K] int8
    as_ptr,  # [M] fp32
    b_ptr,  # [N, K] int8
    bs_ptr,  # [N] fp32
    bias_ptr,  # [N] or dummy
    out_ptr,  # [M, N]
    ws_ptr,  # SPLIT_K > 1: int32 [SPLIT_K, M, N]
    count_ptr,  # SPLIT_K > 1: zeroed int32 counters, one per output tile
    M,
    N,
    K,
    k_tiles_per_split,
    stride_am,
    stride_bn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Int32 sums of int8 products (exact, in any order), then (sum * a_s[m]) * b_s[n] in
    float64 (the reference's arithmetic: exact sum, two roundings), fp32, + bias, cast."""
    pid_m, pid_n = _tile_ids(M, N, GROUP_M, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    b_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_lo = tl.program_id(1) * k_tiles_per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + k_tiles_per_split * BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + b_rows[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k0)
            b = tl.load(b_ptrs + k0)
        else:
            k_mask = (k0 + offs_k < K)[None, :]
            a = tl.load(a_ptrs + k0, mask=k_mask, other=0)
            b = tl.load(b_ptrs + k0, mask=k_mask, other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        acc, out_mask = _split_k_sum(acc, ws_ptr, count_ptr, offs_m, offs_n, M, N, SPLIT_K)
    a_s = tl.load(as_ptr + a_rows).to(tl.float64)
    b_s = tl.load(bs_ptr + b_rows).to(tl.float64)
    y = ((acc.to(tl.float64) * a_s[:, None]) * b_s[None, :]).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


def int8_gemm_config(num_rows: int, n: int, k: int, sms: int, interpreted: bool = False) -> dict:
    """The launch of ``_int8_gemm_kernel``: 16-row tiles split over K for a few rows (weight
    bound), 128 x 128 tiles over 128-deep K steps for many (MMA bound). NOTE: from the w8a8 FP8
    GEMM's measured tiles (quant.gemm_config), not yet measured for int8."""
    if interpreted:
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1, GROUP_M=1)
    elif num_rows <= 64:
        block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
        cfg = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4,
                   GROUP_M=1)  # fmt: skip
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, GROUP_M=8)
    tiles = triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    cfg["SPLIT_K"] = split_for(tiles, triton.cdiv(k, cfg["BLOCK_K"]), sms, 2)
    return cfg


def int8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """a int8 [M, K] (row scales [M]) x b int8 [N, K]^T (channel scales [N]) (+ bias) -> [M, N]."""
    num_rows, k = a.shape
    n = b.shape[0]
    out = torch.empty((num_rows, n), dtype=out_dtype, device=a.device)
    if num_rows == 0 or n == 0:
        return out
    a, b, a_scale, b_scale, bias = map(_contiguous, (a, b, a_scale, b_scale, bias))
    sms = num_sms(a.device)
    cfg = int8_gemm_config(num_rows, n, k, sms, is_interpreted(a.device))
    cfg.update(config or {})
    tiles = triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if cfg["SPLIT_K"] is None:  # an override's "choose"
        cfg["SPLIT_K"] = split_for(tiles, triton.cdiv(k, cfg["BLOCK_K"]), sms, 2)
    splits, per_split, counters = _launch_split(a.device, tiles, k, cfg)
    ws = a.new_empty((splits, num_rows, n), dtype=torch.int32) if splits > 1 else out
    _int8_gemm_kernel[(tiles, splits)](
        a, a_scale, b, b_scale, bias if bias is not None else out, out, ws,
        counters if counters is not None else a_scale, num_rows, n, k, per_split, a.stride(0),
        b.stride(0), out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0,
        SPLIT_K=splits, GROUP_M=cfg["GROUP_M"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """See ``atom_kernels.int8_linear``: x quantized per token (or statically), then the int8
    GEMM with the row and channel scales in its epilogue."""
    n, k = weight.shape
    if k == 0:
        out = torch.zeros((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        return out + bias if bias is not None else out
    q, x_scale = quantize_int8(as_rows(x), input_scale)
    out = int8_gemm(q, x_scale, weight, weight_scale, bias, x.dtype)
    return out.view(*x.shape[:-1], n)
