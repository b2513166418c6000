"""The decode W4A16 K loop on tensor cores with a packed unpack (``PACKED_DOT``, a variant of
``int_quant._permuted_k_loop``'s dots; ``int_quant.wna16_config`` says where it stands).

The permuted loop's dots take value j of every word of a K tile as one [BLOCK_N, BLOCK_KP] slice
met by x at the same k; each weight costs a shift-free AND-OR into an fp32 mantissa, an fp32
subtraction and a conversion to x's 16-bit type. Here two words' value j become one 32-bit pair of
16-bit floats with no fp32 step: a byte permute (``prmt``) brings byte i of two adjacent words into
the low bytes of the pair's halves, an AND-OR puts its low (or, after one shift, high) nibble q in
the mantissa of 128.0 (bf16; 1024.0 for fp16), so the half is the float 128 + q exactly, and one
packed FMA (``fma.rn.bf16x2``, sm_80+) takes off 128 + zero: q - zero, exact (a small integer).
Per pair of words (16 weights): 4 byte permutes, 4 shifts, 8 AND-ORs and 8 packed FMAs, 1.5
instructions a weight (the fp32 path: ~3 before its layout conversion); the multiply-adds run
in ``tl.dot`` (BLOCK_M = 16, rows past M are zero) and the tile's sum is scaled once a tile
(BLOCK_K divides the group: one scale a column), as SCALE_LATER.

x: the dots' A operands are x at k = k0 + 8 w + j, strided; loaded as 8 [BLOCK_M, BLOCK_KP]
tiles they reach the MMAs' layout through shared memory (sm_90 SASS: 16 loads and 4 barriers a
K tile); ``X_SPLIT`` loads them as one [BLOCK_M, BLOCK_KP, 8] tile (a word column's 8 x
contiguous) split in registers, which Triton streams through cp.async with the words (no x
load, store or barrier in the loop).
NOTE (one H200, 2026-12-01, benchmarks/results/int-quant/s25/x-split/, cold-L2 graphs, one
call; us for qkv / o / gate_up / down at 128 x 128 tiles, 4 stages, K split to fill the SMs):
16 rows 20.2 / 16.5 / 70.6 / 39.9 plain, 16.6 / 12.4 / 44.0 / 30.2 X_SPLIT; 4 rows 14.5 / 13.4 /
44.3 / 29.3 plain, 14.6 / 11.4 / 45.7 / 32.5 X_SPLIT; one row both lose to the multiply-adds
(X_VECTOR 11.4 / 9.3 / 34.8 / 22.0 against X_SPLIT 14.3 / 11.6 / 40.8 / 26.0). Engine decode
(Llama-3-8B shape, W4A16) with X_SPLIT at every row against the plain load: batch 4 3.94 /
3.72 ms, 8 4.07 / 4.35, 16 4.16 / 5.65: the default takes it from 8 rows.

The unpack is inline PTX (``tl.inline_asm_elementwise``, two int32 words an instance): NVIDIA
only. Triton's interpreter and other GPUs take the same values from plain shifts and masks
(``_unpack_plain``), so the interpreter tests this loop's arithmetic; the PTX itself is checked
against the reference on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atom_kernels.backends.triton.int_quant_small_magic import eight_values

# Selectors of ``prmt.b32 d, a, b, sel`` (bytes 0-3: a's, 4-7: b's) placing byte i of a at byte 0
# and byte i of b at byte 2 (bytes 1 and 3 repeat them: masked off).
_PRMT = ("0x4400", "0x5511", "0x6622", "0x7733")


def _unpack_asm(magic: str, scaled: bool = False) -> str:
    """PTX for 8 packed outputs $0..$7 (value j of the words $8, $9 as two 16-bit floats minus
    zero) given $10 = -(magic + zero) as two 16-bit floats and ``magic`` the pair 0xMMMMMMMM of
    the float whose mantissa takes a nibble (bf16 128.0: 0x43004300; fp16 1024.0: 0x64006400);
    ``scaled``: times $11, two 16-bit scales (one more packed FMA a pair: (q - zero) * scale
    rounded once, the exact product's rounding, as the reference's fp32 product rounded)."""
    one = "0x3F803F80" if magic == "0x43004300" else "0x3C003C00"
    fma = "fma.rn.bf16x2" if magic == "0x43004300" else "fma.rn.f16x2"
    lines = ["{", ".reg .b32 t, u, one, nzero;", f"mov.b32 one, {one};",
             "mov.b32 nzero, 0x80008000;"]  # fmt: skip
    for i, sel in enumerate(_PRMT):
        lines += [
            f"prmt.b32 t, $8, $9, {sel};",
            "shr.u32 u, t, 4;",
            f"lop3.b32 ${2 * i}, t, 0x000F000F, {magic}, 0xEA;",  # (t & mask) | magic
            f"lop3.b32 ${2 * i + 1}, u, 0x000F000F, {magic}, 0xEA;",
            f"{fma} ${2 * i}, ${2 * i}, one, $10;",
            f"{fma} ${2 * i + 1}, ${2 * i + 1}, one, $10;",
        ]
        if scaled:  # + -0.0: the product alone, rounded once (x * s + -0 is x * s, signs too)
            lines += [f"{fma} ${2 * i}, ${2 * i}, $11, nzero;",
                      f"{fma} ${2 * i + 1}, ${2 * i + 1}, $11, nzero;"]  # fmt: skip
    return "\n".join(lines + ["}"])


_ASM_BF16 = tl.constexpr(_unpack_asm("0x43004300"))
_ASM_FP16 = tl.constexpr(_unpack_asm("0x64006400"))
_ASM_BF16_SCALED = tl.constexpr(_unpack_asm("0x43004300", scaled=True))
_ASM_FP16_SCALED = tl.constexpr(_unpack_asm("0x64006400", scaled=True))


@triton.jit
def magic_of(DTYPE: tl.constexpr):
    """The float whose mantissa takes a nibble in ``_unpack``: 128 (bf16), 1024 (fp16)."""
    return 128 if DTYPE == tl.bfloat16 else 1024


@triton.jit
def _unpack_plain(words, nz, DTYPE: tl.constexpr):
    """``_unpack`` by shifts and masks (the interpreter, other GPUs): the same values."""
    bias = nz.to(tl.float32) + magic_of(DTYPE)  # -zero
    w0 = (((words >> 0) & 0xF).to(tl.float32) + bias).to(DTYPE)
    w1 = (((words >> 4) & 0xF).to(tl.float32) + bias).to(DTYPE)
    w2 = (((words >> 8) & 0xF).to(tl.float32) + bias).to(DTYPE)
    w3 = (((words >> 12) & 0xF).to(tl.float32) + bias).to(DTYPE)
    w4 = (((words >> 16) & 0xF).to(tl.float32) + bias).to(DTYPE)
    w5 = (((words >> 20) & 0xF).to(tl.float32) + bias).to(DTYPE)
    w6 = (((words >> 24) & 0xF).to(tl.float32) + bias).to(DTYPE)
    w7 = (((words >> 28) & 0xF).to(tl.float32) + bias).to(DTYPE)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _unpack(words, nz, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """(value j - zero for j = 0..7), each [BLOCK_N, BLOCK_KP] in DTYPE, exact; ``nz`` is
    -(magic + zero) in DTYPE, [BLOCK_N, BLOCK_KP] (``magic_of``)."""
    if not ASM:
        w = _unpack_plain(words, nz, DTYPE)
    elif DTYPE == tl.bfloat16:
        w = tl.inline_asm_elementwise(
            _ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", args=[words, nz],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                   tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
        )  # fmt: skip
    else:
        w = tl.inline_asm_elementwise(
            _ASM_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", args=[words, nz],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                   tl.float16, tl.float16), is_pure=True, pack=2,
        )  # fmt: skip
    return w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]


@triton.jit
def unpack_scaled(words, nz, scale, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """((value j - zero) * scale rounded once to DTYPE, j = 0..7), each of ``words``' shape:
    ``nz`` -(magic + zero) and ``scale`` in DTYPE of that shape (the fused MoE's weight tiles,
    the reference's dequantized weights exactly)."""
    if not ASM:
        bias = nz.to(tl.float32) + magic_of(DTYPE)  # -zero
        s = scale.to(tl.float32)
        w0 = ((((words >> 0) & 0xF).to(tl.float32) + bias) * s).to(DTYPE)
        w1 = ((((words >> 4) & 0xF).to(tl.float32) + bias) * s).to(DTYPE)
        w2 = ((((words >> 8) & 0xF).to(tl.float32) + bias) * s).to(DTYPE)
        w3 = ((((words >> 12) & 0xF).to(tl.float32) + bias) * s).to(DTYPE)
        w4 = ((((words >> 16) & 0xF).to(tl.float32) + bias) * s).to(DTYPE)
        w5 = ((((words >> 20) & 0xF).to(tl.float32) + bias) * s).to(DTYPE)
        w6 = ((((words >> 24) & 0xF).to(tl.float32) + bias) * s).to(DTYPE)
        w7 = ((((words >> 28) & 0xF).to(tl.float32) + bias) * s).to(DTYPE)
        w = (w0, w1, w2, w3, w4, w5, w6, w7)
    elif DTYPE == tl.bfloat16:
        w = tl.inline_asm_elementwise(
            _ASM_BF16_SCALED, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", args=[words, nz, scale],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                   tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
        )  # fmt: skip
    else:
        w = tl.inline_asm_elementwise(
            _ASM_FP16_SCALED, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", args=[words, nz, scale],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                   tl.float16, tl.float16), is_pure=True, pack=2,
        )  # fmt: skip
    return w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]


@triton.jit
def _packed_dot_k_loop(
    x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, m_mask, k_lo, k_hi, K, group_size, stride_xm,
    stride_qn, stride_sn, stride_zn, HAS_ZEROS: tl.constexpr, EVEN_K: tl.constexpr,
    ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_SPLIT: tl.constexpr = False,
):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] fp32 sums of k_lo <= k < k_hi, 4-bit weights, 16-bit x, permuted K
    (column w of a tile: k = k0 + 8 * w + j), BLOCK_K dividing the group size: 8 dots a tile of
    q - zero (exact in x's type), the tile's sum scaled once."""
    BLOCK_KP: tl.constexpr = BLOCK_K // 8
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    offs_kp = tl.arange(0, BLOCK_KP)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_kp[None, :]  # [BLOCK_N, BLOCK_KP]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (offs_kp * 8)[None, :]
    if X_SPLIT:  # [BLOCK_M, BLOCK_KP, 8]: a word column's 8 x contiguous (one vector load)
        x3_ptrs = x_ptrs[:, :, None] + tl.arange(0, 8)[None, None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kp0 = k0 // 8
        if EVEN_K:
            kp_mask = tl.full([BLOCK_KP], 1, tl.int1)
            words = tl.load(q_ptrs + kp0)
        else:  # K is a multiple of 8: a word is wholly in K or wholly past it (x is 0 there)
            kp_mask = (kp0 + offs_kp) * 8 < K
            words = tl.load(q_ptrs + kp0, mask=kp_mask[None, :], other=0)
        x_mask = m_mask[:, None] & kp_mask[None, :]
        group = k0 // group_size
        s = tl.load(s_ptr + rows * stride_sn + group).to(tl.float32)
        if HAS_ZEROS:  # -(magic + zero): exact in DTYPE (integer zeros < 16)
            z = tl.load(z_ptr + rows * stride_zn + group).to(tl.float32)
            nz = tl.broadcast_to((-(z + magic_of(DTYPE))).to(DTYPE)[:, None], words.shape)
        else:
            nz = tl.full(words.shape, -(magic_of(DTYPE) + 8), DTYPE)
        w0, w1, w2, w3, w4, w5, w6, w7 = _unpack(words, nz, DTYPE, ASM)
        if X_SPLIT:  # the 8 values' x from one [BLOCK_M, BLOCK_KP, 8] load, split in registers
            xv = tl.load(x3_ptrs + k0, mask=x_mask[:, :, None], other=0.0)
            xv = tl.reshape(xv, [BLOCK_M, BLOCK_KP, 2, 2, 2])  # j = 4a + 2b + c
            x0, x1, x2, x3, x4, x5, x6, x7 = eight_values(xv)
        else:  # x of value j: a strided [BLOCK_M, BLOCK_KP] load each
            x0 = tl.load(x_ptrs + k0 + 0, mask=x_mask, other=0.0)
            x1 = tl.load(x_ptrs + k0 + 1, mask=x_mask, other=0.0)
            x2 = tl.load(x_ptrs + k0 + 2, mask=x_mask, other=0.0)
            x3 = tl.load(x_ptrs + k0 + 3, mask=x_mask, other=0.0)
            x4 = tl.load(x_ptrs + k0 + 4, mask=x_mask, other=0.0)
            x5 = tl.load(x_ptrs + k0 + 5, mask=x_mask, other=0.0)
            x6 = tl.load(x_ptrs + k0 + 6, mask=x_mask, other=0.0)
            x7 = tl.load(x_ptrs + k0 + 7, mask=x_mask, other=0.0)
        part = tl.dot(x0, tl.trans(w0))
        part = tl.dot(x1, tl.trans(w1), part)
        part = tl.dot(x2, tl.trans(w2), part)
        part = tl.dot(x3, tl.trans(w3), part)
        part = tl.dot(x4, tl.trans(w4), part)
        part = tl.dot(x5, tl.trans(w5), part)
        part = tl.dot(x6, tl.trans(w6), part)
        part = tl.dot(x7, tl.trans(w7), part)
        acc += part * s[None, :]
    return acc
