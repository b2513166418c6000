"""The one-row W4A16 K loop without a per-weight subtraction (``SMALL_MAGIC``, a variant of
``int_quant._permuted_k_loop``'s multiply-adds; ``int_quant.wna16_config`` says where it stands).

The permuted loop turns each 4-bit value into a float with one AND-OR (its bits OR-ed into the
mantissa of a power of two: the float 2**(23 - p) + q for a value at bit p) and then subtracts
the magic and the zero from every weight before its multiply-add. Here the subtraction leaves
the weights: value j of word column w is masked at bit p_j (15 or 19, after one shift a pair of
values), the float f = M_j + q (M_j = 2**(23 - p_j): 256 or 16) multiplies x as it is, and the
sum of what was not subtracted, sum_j (M_j + zero) * x_j, is the x-only correction of the
column, which starts each tile's sum (so it costs no instruction a weight where the zero is one
number, one multiply-add a word where zeros are per row):

    part[n, w] = -(XM[w] + zero[n] * XS[w]) + sum_j f[n, w, j] * x[w, j]
    XM[w] = sum_j M_j * x[w, j]    XS[w] = sum_j x[w, j]

Per word (8 weights): 4 shifts, 8 AND-ORs and 8 multiply-adds, against the permuted loop's 1
shift, 8 AND-ORs, 8 subtractions and 8 multiply-adds.
NOTE (sm_90 SASS from Triton 3.9's bundled ptxas, no GPU: instructions in the main loop a weight,
BLOCK_N 256, BLOCK_K 128, 4 warps, bf16 x, counts not times): the permuted loop 4.91 (0.82 of them
moves re-creating the AND-ORs' masks), this loop with constant masks 4.19, with
the masks as runtime values (below) 3.47 symmetric / 3.66 with zeros; 159 registers (163).
Precision: each multiply-add rounds once at the size of the tile's running sum, ~M |x| (256 |x|
at most, not the 2**23 |x| of a magic at bit 0), and the sum restarts every K tile: ~2**-24 * 256
against |q - zero| ~ 4.6, a few 1e-6 of an output, far under a bf16 ulp (2**-8). Measured in the
interpreter (N 64, K 4096, fp32 x, fp32 out; max error over max |y| against float64): 2e-7 to
1.1e-6 with 100x outliers in x (the permuted loop: 1e-7 to 1.7e-7); bf16 outputs equal.
Variants (SMALL_MAGIC_VARIANTS, not defaults; same SASS count, bf16 x, symmetric; not timed on a
GPU yet): the default loads x as 32 16-bit loads a thread a tile (8 a word column, each with a
zeroing move: its mask has the row's m_mask). X_VECTOR (x as 64-bit words, 8 loads, no mask)
3.11 a weight, 128 registers (168 with zeros: 3.66 -> 3.28 a weight); X_SPLIT (a [BLOCK_KP, 8]
load tl.split three times) 3.02, 161 registers, but Triton loads it one element a thread and
moves it through shared memory (STSM, a barrier pair, 8 LDS.128); PREFETCH 3.63, 243 registers
(num_stages 2 gives the default's SASS). Not built: values 4, 5 read unshifted (bits 16, 20) —
bit 23 is the exponent's, a 4-bit value at p needs p <= 19. The loop's one other barrier pair
is the scales' [BLOCK_N] layout conversion (loading them [BLOCK_N, BLOCK_KP] removes it at 3.16
a weight, 167 registers).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The loop's variants, keys of wna16_linear's config (off by default; each a constexpr of
# _wna16_kernel; counts in the module docstring): X_VECTOR loads a word column's x as 64-bit
# integers and takes its halves apart in registers; X_SPLIT loads a tile's x as [BLOCK_KP, 8] and
# tl.splits it; PREFETCH loads the next tile's words before this tile's math.
SMALL_MAGIC_VARIANTS = ("X_VECTOR", "X_SPLIT", "PREFETCH")


@triton.jit
def _magic_value(shifted, mask, p: tl.constexpr):
    """The float 2**(23 - p) + q of the 4-bit value q at bit p of ``shifted`` (``mask``: 0xF << p):
    exact (p + 4 <= 23: the value lies in the mantissa); one AND-OR."""
    return ((shifted & mask) | ((150 - p) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _x_of_value(x_ptrs, k0, j: tl.constexpr, x_mask):
    """x at k = k0 + 8 * w + j for each word column w, in fp32: [BLOCK_M, BLOCK_KP]."""
    return tl.load(x_ptrs + k0 + j, mask=x_mask, other=0.0).to(tl.float32)


@triton.jit
def _x_of_half(half, j: tl.constexpr, IS_BF16: tl.constexpr):
    """x_j (j = 0, 1: the low, high half of the 32-bit ``half``), 16-bit floats, in fp32."""
    if IS_BF16:  # the fp32 of a bf16 is its bits above 16 zeros: one shift or AND
        if j == 0:
            return (half << 16).to(tl.float32, bitcast=True)
        return (half & -65536).to(tl.float32, bitcast=True)
    bits = half if j == 0 else half >> 16
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _x_of_words(xw_ptrs, k0, kp_mask, EVEN_K: tl.constexpr, X_BITS: tl.constexpr,
                IS_BF16: tl.constexpr):  # fmt: skip
    """x at k = k0 + 8 * w + j for j = 0..7, each [1, BLOCK_KP] in fp32, from a word column's x
    loaded as 64-bit integers (``xw_ptrs``: [1, BLOCK_KP] int64 pointers, a column's first word):
    X_BITS / 8 loads of 8 bytes, not 8 of X_BITS / 8 (no layout conversion: each load lands in the
    layout the loop reads, a 64-bit word's halves are two registers)."""
    WORDS: tl.constexpr = X_BITS // 8  # 64-bit words a column
    k_words = k0 // (64 // X_BITS)
    xs = []
    for i in tl.static_range(WORDS):
        if EVEN_K:
            word = tl.load(xw_ptrs + k_words + i)
        else:
            word = tl.load(xw_ptrs + k_words + i, mask=kp_mask[None, :], other=0)
        low = word.to(tl.int32)
        high = (word >> 32).to(tl.int32)
        if X_BITS == 32:
            xs = xs + [low.to(tl.float32, bitcast=True), high.to(tl.float32, bitcast=True)]
        else:
            xs = xs + [_x_of_half(low, 0, IS_BF16), _x_of_half(low, 1, IS_BF16),
                       _x_of_half(high, 0, IS_BF16), _x_of_half(high, 1, IS_BF16)]  # fmt: skip
    return xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]


@triton.jit
def eight_values(xv):
    """x_0 .. x_7 of ``xv`` [..., 2, 2, 2] (value j = 4a + 2b + c at [..., a, b, c]), each
    [...]: three rounds of tl.split, in registers."""
    c0, c1 = tl.split(xv)
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    x0, x4 = tl.split(c0b0)
    x2, x6 = tl.split(c0b1)
    x1, x5 = tl.split(c1b0)
    x3, x7 = tl.split(c1b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_of_values(xv_ptrs, k0, kp_mask, EVEN_K: tl.constexpr, BLOCK_KP: tl.constexpr):
    """x at k = k0 + 8 * w + j for j = 0..7, each [1, BLOCK_KP] in fp32, from one [BLOCK_KP, 8]
    load (a word column's 8 values contiguous: one vector load) split in registers."""
    if EVEN_K:
        xv = tl.load(xv_ptrs + k0)
    else:
        xv = tl.load(xv_ptrs + k0, mask=kp_mask[None, :, None], other=0.0)
    xv = tl.reshape(xv.to(tl.float32), [BLOCK_KP, 2, 2, 2])  # j = 4a + 2b + c
    x0, x1, x2, x3, x4, x5, x6, x7 = eight_values(xv)
    return (
        tl.reshape(x0, [1, BLOCK_KP]), tl.reshape(x1, [1, BLOCK_KP]),
        tl.reshape(x2, [1, BLOCK_KP]), tl.reshape(x3, [1, BLOCK_KP]),
        tl.reshape(x4, [1, BLOCK_KP]), tl.reshape(x5, [1, BLOCK_KP]),
        tl.reshape(x6, [1, BLOCK_KP]), tl.reshape(x7, [1, BLOCK_KP]),
    )  # fmt: skip


@triton.jit
def _small_magic_k_loop(
    x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size, stride_xm,
    stride_qn, stride_sn, stride_zn, HAS_ZEROS: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_VECTOR: tl.constexpr = False, X_SPLIT: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, K_STAGES: tl.constexpr = 1,
):  # fmt: skip
    """The [1, BLOCK_N] fp32 sums of k_lo <= k < k_hi of one row, 4-bit weights, permuted K
    (column w of a tile: k = k0 + 8 * w + j), each word's values as 2**(23 - p) + q with the
    magics and zeros taken off by a per-column correction (module docstring). Without
    SCALE_PER_TILE the scales and zeros are gathered per word (a word lies in one group).
    K_STAGES > 1: the loop's loads pipelined K_STAGES - 1 tiles ahead (``tl.range``'s
    num_stages: cp.async copies into shared memory, no registers held for them; a plain
    ``range`` leaves loads no dot reads unpipelined)."""
    BLOCK_KP: tl.constexpr = BLOCK_K // 8
    # The mantissa bits a value lands on: one shift places two adjacent values, at 15 and 19.
    LOW_BIT: tl.constexpr = 15
    HIGH_BIT: tl.constexpr = 19
    M_LOW: tl.constexpr = 1 << (23 - LOW_BIT)  # 256
    M_HIGH: tl.constexpr = 1 << (23 - HIGH_BIT)  # 16
    # The masks as runtime values (K >= 0): as constants ptxas re-creates one of an AND-OR's two
    # 32-bit constants (a LOP3 takes one immediate) by a move before each AND-OR (sm_90: 4.19 ->
    # 3.47 instructions a weight; test_small_magic_main_loop_sass).
    mask_low = tl.where(K < 0, 0, 0xF << LOW_BIT)
    mask_high = tl.where(K < 0, 0, 0xF << HIGH_BIT)
    offs_kp = tl.arange(0, BLOCK_KP)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_kp[None, :]  # [BLOCK_N, BLOCK_KP]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (offs_kp * 8)[None, :]
    X_BITS: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth
    IS_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    if X_VECTOR:  # the row's x as 64-bit words (the launcher aligns the row to 16 bytes)
        x_row = (x_ptr + offs_m[:, None].to(tl.int64) * stride_xm).to(tl.pointer_type(tl.int64))
        xw_ptrs = x_row + (offs_kp * (X_BITS // 8))[None, :]  # [1, BLOCK_KP], column w's first
    if X_SPLIT:  # [BLOCK_M = 1, BLOCK_KP, 8]: a word column's 8 x contiguous (one vector load)
        offs_j = tl.arange(0, 8)
        xv_ptrs = (x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm
                   + (offs_kp * 8)[None, :, None] + offs_j[None, None, :])  # fmt: skip
    if PREFETCH:  # the next tile's words load before this tile's math (a register double buffer)
        # the start of the split's last tile: its next load re-reads it (unmasked, an L1 hit)
        k_last = k_lo + (k_hi - k_lo - 1) // BLOCK_K * BLOCK_K
        if EVEN_K:
            words_next = tl.load(q_ptrs + k_lo // 8)
        else:
            words_next = tl.load(
                q_ptrs + k_lo // 8, mask=((k_lo // 8 + offs_kp) * 8 < K)[None, :], other=0
            )
    acc2 = tl.zeros([BLOCK_N, BLOCK_KP], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=K_STAGES):
        kp0 = k0 // 8
        if EVEN_K:
            kp_mask = tl.full([BLOCK_KP], 1, tl.int1)
        else:  # K is a multiple of 8: a word is wholly in K or wholly past it (0: f = M_j, x 0)
            kp_mask = (kp0 + offs_kp) * 8 < K
        if PREFETCH:
            words = words_next
            kp_next = tl.minimum(k0 + BLOCK_K, k_last) // 8
            if EVEN_K:
                words_next = tl.load(q_ptrs + kp_next)
            else:
                next_mask = (kp_next + offs_kp) * 8 < K
                words_next = tl.load(q_ptrs + kp_next, mask=next_mask[None, :], other=0)
        elif EVEN_K:
            words = tl.load(q_ptrs + kp0)
        else:
            words = tl.load(q_ptrs + kp0, mask=kp_mask[None, :], other=0)
        x_mask = m_mask[:, None] & kp_mask[None, :]
        if SCALE_PER_TILE:  # one group for the whole tile: [BLOCK_N] vectors
            group = k0 // group_size
            s = tl.load(s_ptr + rows * stride_sn + group).to(tl.float32)[:, None]
            if HAS_ZEROS:
                z = tl.load(z_ptr + rows * stride_zn + group).to(tl.float32)[:, None]
        else:  # a group per word: [BLOCK_N, BLOCK_KP], a few distinct ones (L1 hits)
            groups = tl.where(kp_mask, (k0 + offs_kp * 8) // group_size, 0)
            s = tl.load(s_ptr + rows[:, None] * stride_sn + groups[None, :]).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + rows[:, None] * stride_zn + groups[None, :]).to(tl.float32)
        if X_VECTOR:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_of_words(
                xw_ptrs, k0, kp_mask, EVEN_K, X_BITS, IS_BF16
            )
        elif X_SPLIT:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_of_values(xv_ptrs, k0, kp_mask, EVEN_K, BLOCK_KP)
        else:  # x of each value j (explicit: each is loaded once and read twice), [1, BLOCK_KP]
            x0 = _x_of_value(x_ptrs, k0, 0, x_mask)
            x1 = _x_of_value(x_ptrs, k0, 1, x_mask)
            x2 = _x_of_value(x_ptrs, k0, 2, x_mask)
            x3 = _x_of_value(x_ptrs, k0, 3, x_mask)
            x4 = _x_of_value(x_ptrs, k0, 4, x_mask)
            x5 = _x_of_value(x_ptrs, k0, 5, x_mask)
            x6 = _x_of_value(x_ptrs, k0, 6, x_mask)
            x7 = _x_of_value(x_ptrs, k0, 7, x_mask)
        x_low = (x0 + x2) + (x4 + x6)  # values at LOW_BIT (magic M_LOW)
        x_high = (x1 + x3) + (x5 + x7)  # values at HIGH_BIT (magic M_HIGH)
        # the tile's sum starts at -(XM + zero * XS): the column's correction
        if HAS_ZEROS:
            part = tl.fma(z, -(x_low + x_high), -(M_LOW * x_low + M_HIGH * x_high))
        else:  # the symmetric zero, 8
            part = -((M_LOW + 8) * x_low + (M_HIGH + 8) * x_high)
        part = tl.broadcast_to(part, [BLOCK_N, BLOCK_KP])
        pair = words << LOW_BIT  # values 0, 1 at bits 15, 19
        part = tl.fma(_magic_value(pair, mask_low, LOW_BIT), x0, part)
        part = tl.fma(_magic_value(pair, mask_high, HIGH_BIT), x1, part)
        pair = words << (LOW_BIT - 8)  # values 2, 3
        part = tl.fma(_magic_value(pair, mask_low, LOW_BIT), x2, part)
        part = tl.fma(_magic_value(pair, mask_high, HIGH_BIT), x3, part)
        pair = words >> (16 - LOW_BIT)  # values 4, 5 (sign bits fill above bit 23: masked off)
        part = tl.fma(_magic_value(pair, mask_low, LOW_BIT), x4, part)
        part = tl.fma(_magic_value(pair, mask_high, HIGH_BIT), x5, part)
        pair = words >> (24 - LOW_BIT)  # values 6, 7
        part = tl.fma(_magic_value(pair, mask_low, LOW_BIT), x6, part)
        part = tl.fma(_magic_value(pair, mask_high, HIGH_BIT), x7, part)
        acc2 = tl.fma(part, s, acc2)
    return tl.reshape(tl.sum(acc2, axis=1), [BLOCK_M, BLOCK_N])
