"""WNA16 experts (``quant="wna16"``) in the Triton fused MoE: 4- or 8-bit integer weights packed in
int32 along the input dim, dequantized tile by tile in the GEMMs' K loops (weight-only: the
activations stay in hidden_states' dtype). ``moe.fused_moe`` hands quant="wna16" calls here.

Layout per expert (``atom_kernels.ops.int_quant``): w [E, N, K * bits / 32] int32, 32 / bits
values of consecutive k per word, lowest bits first, unsigned; scales [E, N, G] in the activation
dtype; zeros None (symmetric: 2**(bits - 1)) or [E, N, G]. The weight is (q - zero) * scale,
computed in float32 and rounded once to the activation dtype: the torch reference's dequantized
experts exactly, so both sides multiply the same numbers (summation order differs).

Two paths, both reusing ``moe.py``'s align step (pairs sorted by expert, padded to BLOCK_M) and
its top-k sum kernel:

- per-pair (one token: its slots are distinct experts, so no weight is read twice): no align
  launch; each GEMM program's row block is one pair (row 0 of a 16-row tile) and its expert.
- sorted: a row block holds up to BLOCK_M pairs of one expert, whose weight tiles are read once
  for all of them. At decode sizes (up to ~64 tokens) an expert gets a few pairs and the GEMMs
  stream each routed expert's packed weights and scales once: 16-row tiles, narrow column tiles
  (many programs: every SM streaming) and long K steps (bytes in flight).

A weight tile [BLOCK_K, BLOCK_N] is loaded as its words (each word's address repeated 32 / bits
times along K; the repeats hit L1, DRAM reads each byte once), shifted and masked. Scales and
zeros: one [BLOCK_N] vector per K step when the step lies in one group (group size a multiple of
BLOCK_K), else gathered per element (group 32 with a 128-input step: 4 distinct scales per
column, L1 hits again).

T = tokens, K = experts per token, N = T * K pairs, E = experts, H = hidden size, I = expert
intermediate size, P = padded rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import is_interpreted, next_pow2, num_sms
from atom_kernels.backends.triton.int_quant import value_minus_zero
from atom_kernels.backends.triton.int_quant_packed_dot import magic_of, unpack_scaled
from atom_kernels.backends.triton.moe import (
    _ACTIVATIONS,
    ALIGN_KERNEL_MAX_PAIRS,
    _align_kernel,
    _align_sort,
    _block_expert,
    _sum_topk_kernel,
    _tile,
)

# fp32 pair rows between GEMM 2 and the top-k sum up to this many pairs (no extra rounding, and
# the [N, H] round trip is small next to the weights); above, rows in the activation dtype.
FP32_ROWS_MAX_PAIRS = 4096


@triton.jit
def _weight(q, zero, scale, dtype):
    """Unsigned integers q (int32) -> (q - zero) * scale in ``dtype``, rounded once. q goes to
    float32 by its bits (2**23 + q: q under the mantissa of 2**23), not a conversion instruction
    (a quarter-rate one on Hopper); the subtraction is exact, so is the product (<= 8 + 11
    significant bits), as the reference's float32 math."""
    value = (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + zero)
    return (value * scale).to(dtype)


@triton.jit
def _group_params(
    s_rows, z_rows, groups, mask, col_valid, stride_sk, stride_zk,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SCALE_VEC: tl.constexpr,
):  # fmt: skip
    """(zero, scale) float32 of a K step: SCALE_VEC, the step lies in group ``groups`` (a
    scalar): [1, N] vectors; else ``groups`` [R] the group of each row of the step's tile:
    [R, N] gathered (L1 hits: a few distinct groups per column)."""
    if SCALE_VEC:
        scale = tl.load(s_rows + groups * stride_sk, mask=col_valid, other=0.0)[None, :]
        if HAS_ZEROS:
            zero = tl.load(z_rows + groups * stride_zk, mask=col_valid, other=0.0)[None, :]
    else:
        scale = tl.load(s_rows[None, :] + groups[:, None] * stride_sk, mask=mask, other=0.0)
        if HAS_ZEROS:
            zero = tl.load(z_rows[None, :] + groups[:, None] * stride_zk, mask=mask, other=0.0)
    if HAS_ZEROS:
        zero = zero.to(tl.float32)
    else:
        zero = 2.0 ** (BITS - 1)
    return zero, scale.to(tl.float32)


@triton.jit
def _packed_dots(acc, x_rows, x_mask, js, stride_xk, words, zero, scale, ASM: tl.constexpr):
    """acc + the step's 8 dots, value i of every word met by x at k = 8 j + i, the weights
    from ``unpack_scaled`` (``zero`` / ``scale`` float32, [1, N] or [J, N])."""
    DTYPE: tl.constexpr = x_rows.dtype.element_ty
    # [N, J]: the words of a column along the registers' fast dim, as the dense packed dots
    # (int_quant_packed_dot) take them
    nz = tl.trans((tl.zeros(words.shape, tl.float32) - (zero + magic_of(DTYPE))).to(DTYPE))
    s = tl.trans(tl.broadcast_to(scale, words.shape).to(DTYPE))  # the scales' own values
    words = tl.trans(words)
    w0, w1, w2, w3, w4, w5, w6, w7 = unpack_scaled(words, nz, s, DTYPE, ASM)
    x_ptrs = x_rows + (js * 8)[None, :] * stride_xk  # [M, J]
    acc = tl.dot(tl.load(x_ptrs + 0 * stride_xk, mask=x_mask, other=0.0), tl.trans(w0), acc)
    acc = tl.dot(tl.load(x_ptrs + 1 * stride_xk, mask=x_mask, other=0.0), tl.trans(w1), acc)
    acc = tl.dot(tl.load(x_ptrs + 2 * stride_xk, mask=x_mask, other=0.0), tl.trans(w2), acc)
    acc = tl.dot(tl.load(x_ptrs + 3 * stride_xk, mask=x_mask, other=0.0), tl.trans(w3), acc)
    acc = tl.dot(tl.load(x_ptrs + 4 * stride_xk, mask=x_mask, other=0.0), tl.trans(w4), acc)
    acc = tl.dot(tl.load(x_ptrs + 5 * stride_xk, mask=x_mask, other=0.0), tl.trans(w5), acc)
    acc = tl.dot(tl.load(x_ptrs + 6 * stride_xk, mask=x_mask, other=0.0), tl.trans(w6), acc)
    acc = tl.dot(tl.load(x_ptrs + 7 * stride_xk, mask=x_mask, other=0.0), tl.trans(w7), acc)
    return acc


@triton.jit
def wna16_step(
    acc, acc2, x_rows, x_valid, stride_xk, w_rows, w2_rows, s_rows, s2_rows, z_rows, z2_rows,
    k0, num_k, col_valid, stride_wk, stride_sk, stride_zk,
    TWO: tl.constexpr, BITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
    SCALE_VEC: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr, PACKED: tl.constexpr = False, ASM: tl.constexpr = False,
):  # fmt: skip
    """(acc + x[:, k0 : k0 + BLOCK_K] @ W[k0 : k0 + BLOCK_K, cols], the same for acc2 and W2 when
    ``TWO``), the activations loaded once for both: ``x_rows`` [M, 1] pointers to the activation
    rows (inputs ``stride_xk`` apart), ``x_valid`` [M]; ``w_rows`` [1, N] the packed rows (words
    ``stride_wk`` apart), ``s_rows`` / ``z_rows`` [N] the rows of scales / zeros.

    SPLIT (BLOCK_K / PER >= 16, the dot's least K; GROUP_K a multiple of PER): the step's
    [BLOCK_K / PER, N] words are loaded once (contiguous along K: vector loads), then PER dots,
    dot i over the inputs k = PER * j + i (the i-th value of word j) against those values: a
    dot's sum does not care about the order of its K. Else one [BLOCK_K, N] tile in k order,
    each word's address repeated PER times (the repeats hit L1). PACKED (SPLIT, 4-bit, 16-bit
    x): each word's 8 values as (q - zero) * scale by ``int_quant_packed_dot.unpack_scaled``
    (packed bf16x2 / f16x2 arithmetic in PTX where ASM; the same numbers), ``_packed_dots``."""
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if SPLIT:
        # [J] words of the step (k0 is a multiple of BLOCK_K: whole, aligned vector loads)
        js = tl.multiple_of(k0 // PER, BLOCK_K // PER) + tl.arange(0, BLOCK_K // PER)
        if EVEN_K:  # no mask along K: its constancy would cap the vector width (8 bytes)
            j_valid = tl.full([BLOCK_K // PER], 1, tl.int1)
        else:
            j_valid = js < num_k // PER
        mask = j_valid[:, None] & col_valid[None, :]
        groups = k0 // GROUP_K if SCALE_VEC else js // (GROUP_K // PER)
        words = tl.load(w_rows + js[:, None] * stride_wk, mask=mask, other=0)  # [J, N]
        zero, scale = _group_params(s_rows, z_rows, groups, mask, col_valid, stride_sk,
                                    stride_zk, BITS, HAS_ZEROS, SCALE_VEC)  # fmt: skip
        if TWO:
            words2 = tl.load(w2_rows + js[:, None] * stride_wk, mask=mask, other=0)
            zero2, scale2 = _group_params(s2_rows, z2_rows, groups, mask, col_valid, stride_sk,
                                          stride_zk, BITS, HAS_ZEROS, SCALE_VEC)  # fmt: skip
        x_mask = x_valid[:, None] & j_valid[None, :]
        if PACKED:
            acc = _packed_dots(acc, x_rows, x_mask, js, stride_xk, words, zero, scale, ASM)
            if TWO:
                acc2 = _packed_dots(acc2, x_rows, x_mask, js, stride_xk, words2, zero2, scale2,
                                    ASM)  # fmt: skip
        else:
            for i in tl.static_range(0, PER):
                x = tl.load(x_rows + (js * PER + i)[None, :] * stride_xk, mask=x_mask, other=0.0)
                # (q - zero) * scale rounded once to x's dtype, as ``_weight``; value i masked
                # in place (``value_minus_zero``: one LOP3 a value, no shift or extract)
                w = (value_minus_zero(words, i, zero, BITS) * scale).to(x.dtype)  # [J, N]
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
                if TWO:
                    w2 = (value_minus_zero(words2, i, zero2, BITS) * scale2).to(x.dtype)
                    acc2 = tl.dot(x, w2, acc2, input_precision=PRECISION)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < num_k
        mask = k_valid[:, None] & col_valid[None, :]
        groups = k0 // GROUP_K if SCALE_VEC else ks // GROUP_K
        shifts = ((ks % PER) * BITS)[:, None]
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=x_valid[:, None] & k_valid[None, :],
                    other=0.0)  # [M, K]  # fmt: skip
        words = tl.load(w_rows + (ks // PER)[:, None] * stride_wk, mask=mask, other=0)  # [K, N]
        zero, scale = _group_params(s_rows, z_rows, groups, mask, col_valid, stride_sk,
                                    stride_zk, BITS, HAS_ZEROS, SCALE_VEC)  # fmt: skip
        acc = tl.dot(x, _weight((words >> shifts) & MASK, zero, scale, x.dtype), acc,
                     input_precision=PRECISION)  # fmt: skip
        if TWO:
            words2 = tl.load(w2_rows + (ks // PER)[:, None] * stride_wk, mask=mask, other=0)
            zero2, scale2 = _group_params(s2_rows, z2_rows, groups, mask, col_valid, stride_sk,
                                          stride_zk, BITS, HAS_ZEROS, SCALE_VEC)  # fmt: skip
            acc2 = tl.dot(x, _weight((words2 >> shifts) & MASK, zero2, scale2, x.dtype), acc2,
                          input_precision=PRECISION)  # fmt: skip
    return acc, acc2


@triton.jit
def wna16_row(
    part, part2, x_row, stride_xk, w_rows, w2_rows, s_rows, s2_rows, z_rows, z2_rows,
    k0, num_k, col_valid, stride_wk, stride_sk, stride_zk,
    TWO: tl.constexpr, BITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
    SCALE_VEC: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One live row (the per-pair path) in register multiply-adds, no MMA and no shared memory:
    ``part`` [J, N] float32 (J = BLOCK_K / PER words; the same for ``part2`` / W2 when ``TWO``)
    + the step's products with the row ``x_row`` (a scalar pointer), each word's PER products
    (q - zero) * x summed first, then times the word's scale: per value an AND-OR of the value
    in place into exponent bits (``int_quant.value_minus_zero``), a subtraction and a
    multiply-add. The caller sums
    ``part`` over J after its loop. The weights are never rounded to x's dtype (more exact
    than the reference's, within its tolerances)."""
    PER: tl.constexpr = 32 // BITS
    js = tl.multiple_of(k0 // PER, BLOCK_K // PER) + tl.arange(0, BLOCK_K // PER)  # [J]
    if EVEN_K:
        j_valid = tl.full([BLOCK_K // PER], 1, tl.int1)
    else:
        j_valid = js < num_k // PER
    mask = j_valid[:, None] & col_valid[None, :]
    groups = k0 // GROUP_K if SCALE_VEC else js // (GROUP_K // PER)
    words = tl.load(w_rows + js[:, None] * stride_wk, mask=mask, other=0)  # [J, N]
    zero, scale = _group_params(s_rows, z_rows, groups, mask, col_valid, stride_sk, stride_zk,
                                BITS, HAS_ZEROS, SCALE_VEC)  # fmt: skip
    sum1 = tl.zeros(part.shape, dtype=tl.float32)
    if TWO:
        words2 = tl.load(w2_rows + js[:, None] * stride_wk, mask=mask, other=0)
        zero2, scale2 = _group_params(s2_rows, z2_rows, groups, mask, col_valid, stride_sk,
                                      stride_zk, BITS, HAS_ZEROS, SCALE_VEC)  # fmt: skip
        sum2 = tl.zeros(part.shape, dtype=tl.float32)
    for i in tl.static_range(0, PER):
        x = tl.load(x_row + (js * PER + i) * stride_xk, mask=j_valid, other=0.0)
        x = x.to(tl.float32)[:, None]  # [J, 1]
        sum1 += value_minus_zero(words, i, zero, BITS) * x
        if TWO:
            sum2 += value_minus_zero(words2, i, zero2, BITS) * x
    part += sum1 * scale
    if TWO:
        part2 += sum2 * scale2
    return part, part2


@triton.jit
def _rows(pid_m, ids_ptr, sorted_ptr, counts_ptr, ends_ptr, num_experts,
          PER_PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """(expert, rows [M] of the GEMM 1 output, pairs [M], row_valid [M]) of row block pid_m;
    expert < 0 or >= num_experts: nothing to do (a -1 pair, a block past the last segment)."""
    offs_m = tl.arange(0, BLOCK_M)
    if PER_PAIR:  # one pair per row block, in row 0
        expert = tl.load(ids_ptr + pid_m).to(tl.int32)
        row_valid = offs_m == 0
        rows = pid_m + offs_m * 0
        pairs = rows
    else:
        expert, first, count = _block_expert(pid_m, ends_ptr, counts_ptr, num_experts, BLOCK_M,
                                             BLOCK_E)  # fmt: skip
        row_valid = first + offs_m < count
        rows = pid_m * BLOCK_M + offs_m
        pairs = tl.load(sorted_ptr + rows, mask=row_valid, other=0)
    return expert, rows.to(tl.int64), pairs.to(tl.int64), row_valid


@triton.jit(do_not_specialize=["num_row_blocks", "group_m"])
def _wna16_gemm1_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ids_ptr, sorted_ptr, counts_ptr, ends_ptr,
    num_row_blocks, group_m, num_experts, hidden_size, inter_size, top_k,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_ze, stride_zn, stride_zk, stride_be, stride_bn, stride_om, alpha, limit,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZEROS: tl.constexpr, SCALE_VEC: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, ROW: tl.constexpr, ACTIVATION: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    PER_PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, PACKED: tl.constexpr = False, ASM: tl.constexpr = False,
):  # fmt: skip
    """out[rows, cols] = act(x[tokens] @ W13[expert, gate / up rows]^T + b13): x [T, H], w [E, 2I,
    H / PER] packed, out [P or N, I] in x's dtype."""
    pid_m, pid_n = _tile(tl.program_id(0), num_row_blocks, tl.cdiv(inter_size, BLOCK_N), group_m)
    expert, rows, pairs, row_valid = _rows(pid_m, ids_ptr, sorted_ptr, counts_ptr, ends_ptr,
                                           num_experts, PER_PAIR, BLOCK_M, BLOCK_E)  # fmt: skip
    if (expert < 0) | (expert >= num_experts):
        return
    e = expert.to(tl.int64)
    tokens = pairs // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] columns of the output
    col_valid = cols < inter_size
    if INTERLEAVED:
        gate_rows, up_rows = 2 * cols, 2 * cols + 1
    else:
        gate_rows, up_rows = cols, cols + inter_size
    wg_rows = w_ptr + e * stride_we + gate_rows[None, :].to(tl.int64) * stride_wn  # [1, N]
    wu_rows = w_ptr + e * stride_we + up_rows[None, :].to(tl.int64) * stride_wn
    sg_rows = s_ptr + e * stride_se + gate_rows.to(tl.int64) * stride_sn  # [N]
    su_rows = s_ptr + e * stride_se + up_rows.to(tl.int64) * stride_sn
    zg_rows = z_ptr + e * stride_ze + gate_rows.to(tl.int64) * stride_zn
    zu_rows = z_ptr + e * stride_ze + up_rows.to(tl.int64) * stride_zn
    x_rows = x_ptr + tokens[:, None] * stride_xt  # [M, 1]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ROW:  # per-pair, one live row: register multiply-adds (``wna16_row``)
        x_row = x_ptr + (pid_m // top_k).to(tl.int64) * stride_xt
        part_g = tl.zeros([BLOCK_K // (32 // BITS), BLOCK_N], dtype=tl.float32)
        part_u = tl.zeros([BLOCK_K // (32 // BITS), BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            part_g, part_u = wna16_row(
                part_g, part_u, x_row, stride_xh, wg_rows, wu_rows, sg_rows, su_rows, zg_rows,
                zu_rows, k0, hidden_size, col_valid, stride_wk, stride_sk, stride_zk, True, BITS,
                GROUP_K, HAS_ZEROS, SCALE_VEC, EVEN_K, BLOCK_K,
            )  # fmt: skip
        acc_g += tl.sum(part_g, axis=0)[None, :]
        acc_u += tl.sum(part_u, axis=0)[None, :]
    else:
        for k0 in range(0, hidden_size, BLOCK_K):
            acc_g, acc_u = wna16_step(
                acc_g, acc_u, x_rows, row_valid, stride_xh, wg_rows, wu_rows, sg_rows, su_rows,
                zg_rows, zu_rows, k0, hidden_size, col_valid, stride_wk, stride_sk, stride_zk,
                True, BITS, GROUP_K, HAS_ZEROS, SCALE_VEC, SPLIT, EVEN_K, PRECISION, BLOCK_K,
                PACKED, ASM,
            )  # fmt: skip
    if HAS_BIAS:
        b_base = bias_ptr + e * stride_be
        acc_g += tl.load(b_base + gate_rows * stride_bn, mask=col_valid, other=0.0).to(tl.float32)
        acc_u += tl.load(b_base + up_rows * stride_bn, mask=col_valid, other=0.0).to(tl.float32)
    # The reference's projection comes out of a GEMM in x's dtype: round as it does.
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit(do_not_specialize=["num_row_blocks", "group_m"])
def _wna16_gemm2_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, topk_weights_ptr, out_ptr, ids_ptr, sorted_ptr,
    counts_ptr, ends_ptr, num_row_blocks, group_m, num_experts, hidden_size, inter_size,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_ze, stride_zn, stride_zk, stride_be, stride_bn, stride_tw, stride_om,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZEROS: tl.constexpr, SCALE_VEC: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, PER_PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    PACKED: tl.constexpr = False, ASM: tl.constexpr = False,
):  # fmt: skip
    """out[pair, cols] = w_pair * (a[row] @ W2[expert, cols]^T + b2): a [P or N, I] (GEMM 1's
    rows), w [E, H, I / PER] packed, out [N, H] one row per pair (fp32 or x's dtype)."""
    pid_m, pid_n = _tile(tl.program_id(0), num_row_blocks, tl.cdiv(hidden_size, BLOCK_N), group_m)
    expert, rows, pairs, row_valid = _rows(pid_m, ids_ptr, sorted_ptr, counts_ptr, ends_ptr,
                                           num_experts, PER_PAIR, BLOCK_M, BLOCK_E)  # fmt: skip
    if (expert < 0) | (expert >= num_experts):
        return
    e = expert.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden_size
    w_rows = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn  # [1, N]
    s_rows = s_ptr + e * stride_se + cols.to(tl.int64) * stride_sn  # [N]
    z_rows = z_ptr + e * stride_ze + cols.to(tl.int64) * stride_zn
    a_rows = a_ptr + rows[:, None] * stride_am  # [M, 1]
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ROW:  # per-pair, one live row: register multiply-adds (``wna16_row``)
        part = tl.zeros([BLOCK_K // (32 // BITS), BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            part, _ = wna16_row(
                part, part, a_ptr + pid_m.to(tl.int64) * stride_am, 1, w_rows, w_rows, s_rows,
                s_rows, z_rows, z_rows, k0, inter_size, col_valid, stride_wk, stride_sk,
                stride_zk, False, BITS, GROUP_K, HAS_ZEROS, SCALE_VEC, EVEN_K, BLOCK_K,
            )  # fmt: skip
        acc += tl.sum(part, axis=0)[None, :]
    else:
        for k0 in range(0, inter_size, BLOCK_K):
            acc, _ = wna16_step(
                acc, acc, a_rows, row_valid, 1, w_rows, w_rows, s_rows, s_rows, z_rows, z_rows, k0,
                inter_size, col_valid, stride_wk, stride_sk, stride_zk, False, BITS, GROUP_K,
                HAS_ZEROS, SCALE_VEC, SPLIT, EVEN_K, PRECISION, BLOCK_K, PACKED, ASM,
            )  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e * stride_be + cols * stride_bn, mask=col_valid, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    weight = tl.load(topk_weights_ptr + pairs * stride_tw, mask=row_valid, other=0.0)
    y = acc.to(dtype).to(tl.float32) * weight.to(tl.float32)[:, None]  # the reference's rounding
    out_ptrs = out_ptr + pairs[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])  # fmt: skip


def wna16_configs(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden_size: int,
    inter_size: int,
    bits: int,
    device: torch.device,
) -> dict:
    """{"per_pair": path, "row_fma": the per-pair path's register loop (``wna16_row``) instead
    of the 16-row MMA, "gemm1": kernel config, "gemm2": kernel config} (BLOCK_M/N/K, num_warps,
    num_stages, GROUP_M; both GEMMs share BLOCK_M). Pass one to ``fused_moe(config=...)`` to
    override.

    NOTE (sm_90 PTX from the AOT compile, triton 3.9, no GPU run yet; counted before both loops
    took ``value_minus_zero``, which drops the shift and extract a value): at Kimi-K2's decode tiles
    the MMA loop spends about 7 instructions a weight value (extract, exponent OR, subtract,
    scale, convert, a 2-byte shared-memory store to reach the MMA operand layout, then ldmatrix),
    the register loop about 4.5 (extract, OR, subtract, multiply-add; the scale once a word):
    ``row_fma`` is the default for one live row until a GPU run says otherwise.

    NOTE: not yet tuned on a GPU (2026-11-27: written and checked under the interpreter only).
    Decode (an expert gets at most a few pairs): 16-row tiles; K steps of 128 bytes of each
    packed row (256 inputs at 4 bits, 128 at 8: whole cache lines, split into 32 / bits dots);
    column tiles as wide as two programs per SM allow (``_widest``; Kimi-K2 at T = 1: 8 pairs
    x 2048 / 32 = 512 GEMM 1 programs, 8 x 7168 / 64 = 896 GEMM 2 ones). The count assumes
    every slot computed here: under expert parallelism most are -1 and fewer programs run."""
    num_pairs = num_tokens * top_k
    per_pair = num_tokens == 1
    if is_interpreted(device):  # small tiles: the interpreter's cost grows with tile size
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, GROUP_M=4)
        return {"per_pair": per_pair, "row_fma": per_pair, "gemm1": cfg, "gemm2": dict(cfg)}
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if per_pair or rows_per_expert <= 16:
        block_k = 1024 // bits
        blocks = num_pairs if per_pair else min(num_pairs, num_experts)
        n1 = _widest(blocks, inter_size, num_sms(device))
        n2 = _widest(blocks, hidden_size, num_sms(device))
        gemm1 = dict(BLOCK_M=16, BLOCK_N=n1, BLOCK_K=block_k, num_warps=4, num_stages=4)
        gemm2 = dict(BLOCK_M=16, BLOCK_N=n2, BLOCK_K=block_k, num_warps=4, num_stages=4)
    else:  # 16 dots' K per step: the split loop (``wna16_step``)
        block_m = 64 if rows_per_expert <= 64 else 128
        warps = 4 if block_m == 64 else 8
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_m, BLOCK_K=512 // bits, num_warps=warps,
                   num_stages=3, GROUP_M=8)  # fmt: skip
        gemm1, gemm2 = cfg, dict(cfg)
    return {"per_pair": per_pair, "row_fma": per_pair, "gemm1": gemm1, "gemm2": gemm2}


def _widest(num_blocks: int, width: int, sms: int) -> int:
    """The widest column tile (64, 32, 16) leaving at least two programs per SM.

    NOTE (sm_90 PTX, triton 3.9, Kimi-K2 decode tiles, 256-input steps): a wider tile shares
    each activation load among more columns; PTX instructions a weight value in the loop,
    16 / 32 / 64 columns: register loop GEMM 1 8.2 / 6.6 / 5.8, GEMM 2 - / 8.1 / 6.5; MMA
    loop GEMM 1 12.0 / 9.1 / 8.2, GEMM 2 15.0 / 10.5 / 9.0. At full bandwidth an H100 has
    about 4.5 a value to spend: the loops are likely ALU-bound, wide tiles first."""
    for block_n in (64, 32):
        if num_blocks * triton.cdiv(width, block_n) >= 2 * sms:
            return block_n
    return 16


def _launch(
    cfg: dict,
    num_row_blocks: int,
    num_k: int,
    group_k: int,
    bits: int,
    row_fma: bool = False,
    x: torch.Tensor | None = None,
) -> tuple[dict, int, dict]:
    """(launch config without GROUP_M, SPLIT and PACKED, group_m, the dequantization constexprs)
    of one GEMM; ``row_fma``: the per-pair path's register loop (``wna16_row``) where the groups
    allow. The MMA loop is split (no interleave: ``wna16_step``) wherever it can be, unless the
    GEMM's config says ``SPLIT=False`` (benchmarks: the tile loop at the same tile); ``PACKED``:
    the split loop's packed unpack, 4-bit weights and 16-bit ``x`` only; by default on NVIDIA
    GPUs wherever it can run (``PACKED=False`` turns it off).

    NOTE (one H200, triton 3.6, torch 2.11, 2026-12-01; benchmarks/moe.py --int4 --int4-packed
    --ep-size 8, results/int-quant/s26/moe-int4-packed-ep8-h200.json): Kimi-K2's INT4 experts, one
    EP=8 rank, cold-L2 graphs, outputs equal (max |diff| 0): 4 / 16 / 64 tokens 196.6 / 385.1 /
    874.2 us unpacked against 163.5 / 328.0 / 771.5 us packed (1.20 / 1.17 / 1.13x). One token
    takes the register loop (``row_fma``), which PACKED does not change."""
    cfg = dict(cfg)
    group_m = cfg.pop("GROUP_M", 0)
    per_int = 32 // bits
    can_split = cfg["BLOCK_K"] // per_int >= 16 and group_k % per_int == 0
    split = cfg.pop("SPLIT", None)
    if split and not can_split:
        raise ValueError(
            f"fused_moe wna16: SPLIT needs BLOCK_K * {bits} / 32 >= 16 and whole words in a "
            f"group (BLOCK_K {cfg['BLOCK_K']}, group {group_k})"
        )
    packed = cfg.pop("PACKED", None)
    split = can_split if split is None else bool(split)
    if packed is None:  # the default: wherever it can run, on NVIDIA (the PTX unpack)
        cuda = x is not None and x.device.type == "cuda" and not torch.version.hip
        packed = split and bits == 4 and cuda and x.dtype in (torch.bfloat16, torch.float16)
    packed = bool(packed)
    if packed and not (split and bits == 4 and x is not None
                       and x.dtype in (torch.bfloat16, torch.float16)):  # fmt: skip
        raise ValueError(
            "fused_moe wna16: PACKED needs the split loop, 4-bit weights and bf16 / fp16 "
            f"activations (split {split}, {bits}-bit, {None if x is None else x.dtype})"
        )
    quant = dict(
        BITS=bits,
        GROUP_K=group_k,
        SCALE_VEC=group_k % cfg["BLOCK_K"] == 0,
        SPLIT=split,
        EVEN_K=num_k % cfg["BLOCK_K"] == 0,
        ROW=row_fma and group_k % per_int == 0,
        PACKED=packed,
        ASM=packed and x.device.type == "cuda" and not torch.version.hip,
    )
    return cfg, group_m if group_m > 0 else max(1, num_row_blocks), quant


def _quant_args(w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None) -> tuple:
    """(w, scale, zeros or scale, strides of the three): the kernels' weight arguments."""
    z = scale if zeros is None else zeros
    return (*w.stride(), *scale.stride(), *z.stride()), z


def fused_moe_wna16(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    gate_up_interleaved: bool,
    swiglu_alpha: float,
    swiglu_limit: float,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """See ``atom_kernels.fused_moe`` (quant="wna16"). hidden_states [T, H] -> [T, H] in its
    dtype; ``config``: a ``wna16_configs`` dict overriding the default (tuning, tests)."""
    num_tokens, hidden_size = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    device, dtype = hidden_states.device, hidden_states.dtype
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or hidden_size == 0:
        return torch.zeros((num_tokens, hidden_size), dtype=dtype, device=device)
    bits = 32 * w13.shape[2] // hidden_size
    group13 = hidden_size // w13_scale.shape[2]  # inputs per group
    group2 = inter_size // w2_scale.shape[2]
    if config is None:
        config = wna16_configs(
            num_tokens, top_k, num_experts, hidden_size, inter_size, bits, device
        )
    per_pair = config["per_pair"]
    row_fma = per_pair and bool(config.get("row_fma"))
    ids = topk_ids.reshape(-1).contiguous()  # [N], indexed without a stride
    weights = topk_weights.reshape(-1)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    block_e = next_pow2(num_experts, 16)
    if per_pair:
        num_row_blocks = num_pairs
        sorted_ids = counts = ends = ids  # unused by the per-pair programs
        activated = torch.empty((num_pairs, inter_size), dtype=dtype, device=device)  # [N, I]
    else:
        block_m = config["gemm1"]["BLOCK_M"]
        assert config["gemm2"]["BLOCK_M"] == block_m
        max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
        num_row_blocks = triton.cdiv(max_rows, block_m)
        sorted_ids = torch.empty(num_row_blocks * block_m, dtype=torch.int32, device=device)
        counts = torch.empty(num_experts, dtype=torch.int32, device=device)
        ends = torch.empty(num_experts, dtype=torch.int32, device=device)
        if num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
            _align_kernel[(1,)](
                ids, sorted_ids, counts, ends, num_pairs, num_experts, BLOCK_M=block_m,
                BLOCK_E=block_e, CHUNK=32 if block_e > 128 else 64, num_warps=4,
            )  # fmt: skip
        else:
            _align_sort(ids, num_experts, block_m, sorted_ids, counts, ends)
        activated = torch.empty((num_row_blocks * block_m, inter_size), dtype=dtype, device=device)

    gemm1, group1, quant1 = _launch(
        config["gemm1"], num_row_blocks, hidden_size, group13, bits, row_fma, hidden_states
    )
    strides13, z13 = _quant_args(w13, w13_scale, w13_zeros)
    b13 = w13 if w13_bias is None else w13_bias
    bias13_strides = (0, 0) if w13_bias is None else tuple(w13_bias.stride())
    grid1 = (num_row_blocks * triton.cdiv(inter_size, gemm1["BLOCK_N"]),)
    _wna16_gemm1_kernel[grid1](
        hidden_states, w13, w13_scale, z13, b13, activated, ids, sorted_ids, counts, ends,
        num_row_blocks, group1, num_experts, hidden_size, inter_size, top_k,
        *hidden_states.stride(), *strides13, *bias13_strides, activated.stride(0),
        float(swiglu_alpha), float(swiglu_limit),
        HAS_ZEROS=w13_zeros is not None, **quant1,
        ACTIVATION=_ACTIVATIONS[activation], INTERLEAVED=bool(gate_up_interleaved),
        HAS_BIAS=w13_bias is not None, PRECISION=precision, PER_PAIR=per_pair, BLOCK_E=block_e,
        **gemm1,
    )  # fmt: skip

    # One row per pair; the rows of -1 pairs are never written (the sum kernel skips them).
    rows_dtype = torch.float32 if num_pairs <= FP32_ROWS_MAX_PAIRS else dtype
    dest = torch.empty((num_pairs, hidden_size), dtype=rows_dtype, device=device)  # [N, H]
    gemm2, group2_m, quant2 = _launch(
        config["gemm2"], num_row_blocks, inter_size, group2, bits, row_fma, hidden_states
    )
    strides2, z2 = _quant_args(w2, w2_scale, w2_zeros)
    b2 = w2 if w2_bias is None else w2_bias
    bias2_strides = (0, 0) if w2_bias is None else tuple(w2_bias.stride())
    grid2 = (num_row_blocks * triton.cdiv(hidden_size, gemm2["BLOCK_N"]),)
    _wna16_gemm2_kernel[grid2](
        activated, w2, w2_scale, z2, b2, weights, dest, ids, sorted_ids, counts, ends,
        num_row_blocks, group2_m, num_experts, hidden_size, inter_size,
        activated.stride(0), *strides2, *bias2_strides, weights.stride(0), dest.stride(0),
        HAS_ZEROS=w2_zeros is not None, **quant2,
        HAS_BIAS=w2_bias is not None, PRECISION=precision, PER_PAIR=per_pair, BLOCK_E=block_e,
        **gemm2,
    )  # fmt: skip

    out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)  # [T, H]
    block_n = min(1024, next_pow2(hidden_size, 16))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden_size, block_n))](
        dest, ids, out, hidden_size, top_k, dest.stride(0), out.stride(0), BLOCK_N=block_n,
    )  # fmt: skip
    return out
