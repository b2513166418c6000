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
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _small_magic_k_loop(
    x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size, stride_xm,
    stride_qn, stride_sn, stride_zn, HAS_ZEROS: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [1, BLOCK_N] fp32 sums of k_lo <= k < k_hi of one row, 4-bit weights, permuted K
    (column w of a tile: k = k0 + 8 * w + j), each word's values as 2**(23 - p) + q with the
    magics and zeros taken off by a per-column correction (module docstring). Without
    SCALE_PER_TILE the scales and zeros are gathered per word (a word lies in one group)."""
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
    acc2 = tl.zeros([BLOCK_N, BLOCK_KP], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kp0 = k0 // 8
        if EVEN_K:
            kp_mask = tl.full([BLOCK_KP], 1, tl.int1)
            words = tl.load(q_ptrs + kp0)
        else:  # K is a multiple of 8: a word is wholly in K or wholly past it (0: f = M_j, x 0)
            kp_mask = (kp0 + offs_kp) * 8 < K
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
        # x of each value j (explicit: each is loaded once and read twice), [1, BLOCK_KP]
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
