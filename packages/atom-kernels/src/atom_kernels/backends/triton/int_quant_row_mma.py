"""The one-row W4A16 K loop on tensor cores, a warp on one row (``ROW_MMA``, a variant of
``int_quant_quad_mma``'s; ``int_quant.wna16_config`` says where it stands).

``int_quant_quad_mma`` gives a warp 8 rows of 64 bytes each a K tile: each load instruction
asks for 8 separate 64-byte pieces of memory (rows 2 KB apart at K = 4096). Here a warp's load is
one row's 512 contiguous bytes (128 words = 1024 values): Triton's coalesced layout of a
[BLOCK_N, 128] int32 tile gives lane l words 4l .. 4l + 3 of its warp's row (``ROW_LAYOUT``; the
sm_90 compile test pins it), and a warp walks its rows' K in order. The MMA is the quads' one
with its 8 columns now 8 chunks of the same row (chunk n: words 16n .. 16n + 15, held by lanes
4n .. 4n + 3) and A's row g the x of chunk g (each lane passes the x of its own words, as there):
D[g][n] = x_chunk_g . w_chunk_n, whose diagonal D[n][n] is chunk n's dot; lane 4n + n // 2 holds
it (register n % 2), so each lane adds its diagonal element, if it holds one, to its first
accumulator element, and the row's result is the sum over its elements (``tl.sum`` over the
tile's columns, once at the end). The other 56 of D's 64 products a column are never read.

Chunks are different K, hence different groups: the scale goes into the weight before the MMA,
(q - zero) * scale rounded once to x's dtype (two packed FMAs a pair: the reference's dequantized
weight exactly), so any group of a multiple of 32 values works (a lane's 4 words lie in one) and
each MMA starts from zero. Per word: 3 shifts, 4 AND-ORs, 8 packed FMAs and 2 MMAs; a lane's 4
words' x pairs and the diagonal pick once per 4 words.

``SCALE_AFTER`` (groups of a multiple of 128 values: a chunk is one group) leaves the weights
unscaled, q - zero exact in x's dtype, and multiplies the diagonal element by the chunk's scale
in fp32 once per 4 words: 4 packed FMAs a word fewer, and the sum no longer carries the
reference's rounding of each weight to x's dtype (a more exact sum, not the same one).

The MMAs are inline PTX (``tl.inline_asm_elementwise``, a lane's 4 words an instance; sm_80+):
NVIDIA only. Triton's interpreter takes the same values from ``_row_plain`` (each lane's 4
words' dot at its first element), so the interpreter tests the loop's bookkeeping; the PTX is
checked against the reference on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atom_kernels.backends.triton.int_quant_packed_dot import magic_of
from atom_kernels.backends.triton.int_quant_quad_mma import (
    _half,
    _pair_dot,
    _row_scalar,
    _x_pairs,
)

# The words tile's register layout the PTX relies on (Triton's coalesced layout of a
# [BLOCK_N, 128] int32 load with 16-byte aligned rows, BLOCK_N a multiple of num_warps).
ROW_LAYOUT = "sizePerThread = [1, 4], threadsPerWarp = [1, 32]"
ROW_WORDS = tl.constexpr(128)  # words of a row in a K tile (BLOCK_K = 1024 at 4 bits)


# PTX: d0, d1 the lane's two columns of the diagonal's sum (D's rows g and g + 8 of the two MMAs),
# p0 / p1 whether the lane holds D[2c][2c] (register 0) or D[2c + 1][2c + 1] (register 1)
_DIAGONAL = [
    "add.f32 d0, d0, e2;",  # column 2c (rows g, g + 8)
    "add.f32 d1, d1, e3;",  # column 2c + 1
    "mov.u32 lane, %laneid;",
    "shr.u32 g, lane, 2;",
    "and.b32 c2, lane, 3;",
    "shl.b32 c2, c2, 1;",
    "setp.eq.u32 p0, g, c2;",  # this lane holds D[2c][2c] (register 0)
    "add.u32 c2, c2, 1;",
    "setp.eq.u32 p1, g, c2;",  # or D[2c + 1][2c + 1] (register 1)
]


def _unpack(word: str, magic: str) -> list[str]:
    """PTX of one word's 8 values as magic + q in t0..t3 (pairs (q_j, q_{j + 4}), exact): one
    AND-OR a pair, the nibbles shifted down for pairs 1..3."""
    lines = [f"lop3.b32 t0, {word}, 0x000F000F, {magic}, 0xEA;"]  # (w & m) | magic
    for j in (1, 2, 3):
        lines += [f"shr.u32 u, {word}, {4 * j};",
                  f"lop3.b32 t{j}, u, 0x000F000F, {magic}, 0xEA;"]  # fmt: skip
    return lines


def _mma_pair(mma: str, xa: str, xb: str, xc: str, xd: str) -> list[str]:
    """PTX of a word's two MMAs: values 0, 4, 1, 5 (t0, t1) into d, 2, 6, 3, 7 (t2, t3) into e,
    one A operand (the word's x pairs) for both."""
    return [
        f"{mma} {{d0, d1, d2, d3}}, {{{xa}, {xc}, {xb}, {xd}}}, {{t0, t1}}, {{d0, d1, d2, d3}};",
        f"{mma} {{e0, e1, e2, e3}}, {{{xa}, {xc}, {xb}, {xd}}}, {{t2, t3}}, {{e0, e1, e2, e3}};",
    ]


def _row_asm(bf16: bool, zeros: bool, scale_after: bool = False, per_word: bool = False) -> str:
    """PTX of one lane's 4 words: outputs $0..$3 the fp32 accumulator after them ($0 plus the
    lane's diagonal element of D, if it holds one; $1..$3 as they were); inputs $4..$7 the
    words, $8..$23 the x pairs (x_0, x_4), (x_1, x_5), (x_2, x_6), (x_3, x_7) of each word (4
    registers each), $24, $25 the words' scale as two 16-bit floats, $26..$29 the accumulator
    before; with ``zeros`` $30, $31 -(magic + zero) as two 16-bit floats (else the symmetric
    zero 8, an immediate).

    One A operand serves both MMAs of a word, as in ``int_quant_quad_mma._quad_asm``: rows g
    meet values 0, 4, 1, 5 in the first (accumulator d), rows g + 8 values 2, 6, 3, 7 in the
    second (e); chunk n's dot is d[n][n] + e[n + 8][n]. ``scale_after``: the weights are
    q - zero, and the picked element is multiplied by the lane's scale ($24's low half) in
    fp32 as it is added (the lane holding chunk n's diagonal holds chunk n's words)."""
    magic = "0x43004300" if bf16 else "0x64006400"
    one = "0x3F803F80" if bf16 else "0x3C003C00"
    nz = "$30" if zeros else ("0xC308C308" if bf16 else "0xE408E408")  # -(magic + 8)
    kind = "bf16" if bf16 else "f16"
    fma = f"fma.rn.{kind}x2"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    assert not (per_word and scale_after), "per-word scales are applied before the MMAs"
    lines = [
        "{",
        ".reg .b32 t0, t1, t2, t3, u, one, nz, sc, mz, lane, g, c2;",
        ".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3, r, fs;",
        ".reg .b16 h0, h1;",
        ".reg .pred p0, p1;",
        f"mov.b32 one, {one};",
        f"mov.b32 nz, {nz};",
        "mov.b32 sc, $24;",
        "mov.b32 mz, 0x80008000;",  # -0.0 twice: x * s + -0 is x * s, rounded once
    ]
    lines += [f"mov.f32 {r}, 0f00000000;" for r in ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3")]
    for i in range(4):
        word = f"${4 + i}"
        xa, xb, xc, xd = (f"${8 + 4 * p + i}" for p in range(4))
        if per_word:  # word i's own scale (and zero) in both halves
            half = "0x1010" if i % 2 == 0 else "0x3232"
            lines.append(f"prmt.b32 sc, ${24 + i // 2}, ${24 + i // 2}, {half};")
            if zeros:
                lines.append(f"prmt.b32 nz, ${30 + i // 2}, ${30 + i // 2}, {half};")
        lines += _unpack(word, magic)
        lines += [f"{fma} t{j}, t{j}, one, nz;" for j in range(4)]  # q - zero, exact
        if not scale_after:
            lines += [f"{fma} t{j}, t{j}, sc, mz;" for j in range(4)]  # (q - zero) * scale
        lines += _mma_pair(mma, xa, xb, xc, xd)
    lines += _DIAGONAL + [
        "selp.f32 r, d1, 0f00000000, p1;",
        "selp.f32 r, d0, r, p0;",
    ]
    if not scale_after:
        lines.append("add.f32 $0, $26, r;")
    elif bf16:  # a bf16's bits are an fp32's top half
        lines += ["shl.b32 u, sc, 16;", "mov.b32 fs, u;", "fma.rn.f32 $0, r, fs, $26;"]
    else:
        lines += ["mov.b32 {h0, h1}, sc;", "cvt.f32.f16 fs, h0;", "fma.rn.f32 $0, r, fs, $26;"]
    lines += [
        "mov.f32 $1, $27;",
        "mov.f32 $2, $28;",
        "mov.f32 $3, $29;",
        "}",
    ]
    return "\n".join(lines)


def _row_xsum_asm(zeros: bool) -> str:
    """PTX of one lane's 4 words with neither the zero nor the scale applied to the weights
    (``XSUM``, bf16 only): each MMA takes magic + q as it unpacks (one AND-OR, exact), so its
    dot is x . (q - zero) + (magic + zero) x-sum; the picked diagonal element r becomes
    (r - (magic + zero) * xs) * scale in fp32, xs the lane's chunk's sum of x
    (``_xsum_asm``). Operands as ``_row_asm``'s, with $30..$33 xs (fp32; $30 used) and, with
    ``zeros``, $34, $35 -(magic + zero) as two bf16 (else -136.0, an immediate)."""
    lines = [
        "{",
        ".reg .b32 t0, t1, t2, t3, u, lane, g, c2;",
        ".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3, r, fs, nzf;",
        ".reg .pred p0, p1;",
    ]
    lines += [f"mov.f32 {r}, 0f00000000;" for r in ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3")]
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    for i in range(4):
        word = f"${4 + i}"
        xa, xb, xc, xd = (f"${8 + 4 * p + i}" for p in range(4))
        lines += _unpack(word, "0x43004300") + _mma_pair(mma, xa, xb, xc, xd)  # 128 + q
    if zeros:  # a bf16's bits are an fp32's top half
        lines += ["shl.b32 u, $34, 16;", "mov.b32 nzf, u;"]
    else:
        lines.append("mov.f32 nzf, 0fC3080000;")  # -(128 + 8)
    lines += _DIAGONAL + [
        "selp.f32 r, d1, d0, p1;",
        "fma.rn.f32 r, nzf, $30, r;",  # minus (magic + zero) times the chunk's x-sum
        "or.pred p0, p0, p1;",
        "selp.f32 r, r, 0f00000000, p0;",
        "shl.b32 u, $24, 16;",
        "mov.b32 fs, u;",
        "fma.rn.f32 $0, r, fs, $26;",
        "mov.f32 $1, $27;",
        "mov.f32 $2, $28;",
        "mov.f32 $3, $29;",
        "}",
    ]
    return "\n".join(lines)


def _xsum_asm() -> str:
    """PTX of a lane's chunk's sum of x over a K tile (``XSUM``): the MMAs of ``_row_asm`` with
    every weight 1.0 (bf16), one a word, rows g and g + 8 of D together chunk g's 128 x (lane 4g
    + c holds them: its own chunk). Inputs $4..$19 the x pairs as ``_row_asm``'s $8..$23;
    output $0 the sum (fp32), $1..$3 zero."""
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    lines = ["{", ".reg .b32 one;", ".reg .f32 d0, d1, d2, d3;", "mov.b32 one, 0x3F803F80;"]
    lines += [f"mov.f32 {r}, 0f00000000;" for r in ("d0", "d1", "d2", "d3")]
    for i in range(4):
        xa, xb, xc, xd = (f"${4 + 4 * p + i}" for p in range(4))
        lines.append(f"{mma} {{d0, d1, d2, d3}}, {{{xa}, {xc}, {xb}, {xd}}}, {{one, one}}, "
                     "{d0, d1, d2, d3};")  # fmt: skip
    lines += ["add.f32 $0, d0, d2;", "mov.f32 $1, 0f00000000;", "mov.f32 $2, 0f00000000;",
              "mov.f32 $3, 0f00000000;", "}"]  # fmt: skip
    return "\n".join(lines)


def _x_asm() -> str:
    """PTX loading one lane's 4 words' x (16 bytes a word at $16..$19) as the MMAs' pairs:
    outputs $0..$3 (x_0, x_4), $4..$7 (x_1, x_5), $8..$11 (x_2, x_6), $12..$15 (x_3, x_7), one
    register a word (byte permutes of the two 32-bit words holding them)."""
    lines = ["{", ".reg .b32 a, b, c, d;"]
    for i in range(4):
        lines += [
            f"ld.global.nc.v4.b32 {{a, b, c, d}}, [${16 + i}];",  # x01, x23, x45, x67
            f"prmt.b32 ${i}, a, c, 0x5410;",
            f"prmt.b32 ${4 + i}, a, c, 0x7632;",
            f"prmt.b32 ${8 + i}, b, d, 0x5410;",
            f"prmt.b32 ${12 + i}, b, d, 0x7632;",
        ]
    return "\n".join(lines + ["}"])


_X_ASM = tl.constexpr(_x_asm())
_X_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 16 + ["l"] * 4))
_ASM_BF16 = tl.constexpr(_row_asm(True, False))
_ASM_BF16_ZEROS = tl.constexpr(_row_asm(True, True))
_ASM_FP16 = tl.constexpr(_row_asm(False, False))
_ASM_FP16_ZEROS = tl.constexpr(_row_asm(False, True))
_ASM_BF16_WORD = tl.constexpr(_row_asm(True, False, per_word=True))
_ASM_BF16_ZEROS_WORD = tl.constexpr(_row_asm(True, True, per_word=True))
_ASM_FP16_WORD = tl.constexpr(_row_asm(False, False, per_word=True))
_ASM_FP16_ZEROS_WORD = tl.constexpr(_row_asm(False, True, per_word=True))
# 4 words' 32-bit loads and 4 16-bit loads (packed in 2 registers), one address each
_LOAD_WORDS = tl.constexpr("\n".join(f"ld.global.b32 ${i}, [${4 + i}];" for i in range(4)))
_LOAD_HALVES = tl.constexpr(
    "{\n.reg .b16 h0, h1, h2, h3;\n"
    + "".join(f"ld.global.nc.b16 h{i}, [${2 + i}];\n" for i in range(4))
    + "mov.b32 $0, {h0, h1};\nmov.b32 $1, {h2, h3};\n}"
)
_ASM_BF16_AFTER = tl.constexpr(_row_asm(True, False, True))
_ASM_BF16_ZEROS_AFTER = tl.constexpr(_row_asm(True, True, True))
_ASM_FP16_AFTER = tl.constexpr(_row_asm(False, False, True))
_ASM_FP16_ZEROS_AFTER = tl.constexpr(_row_asm(False, True, True))
_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 22 + ["f"] * 4))
_CONSTRAINTS_ZEROS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 22 + ["f"] * 4 + ["r"] * 2))
_ASM_XSUM = tl.constexpr(_row_xsum_asm(False))
_ASM_XSUM_ZEROS = tl.constexpr(_row_xsum_asm(True))
_XSUM_ASM = tl.constexpr(_xsum_asm())
_XSUM_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 16))
_CONSTRAINTS_XSUM = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 22 + ["f"] * 8))
_CONSTRAINTS_XSUM_ZEROS = tl.constexpr(
    "=f,=f,=f,=f," + ",".join(["r"] * 22 + ["f"] * 8 + ["r"] * 2)
)


@triton.jit
def _scaled_pair_dot(words, pair, j: tl.constexpr, minus_zero, s, DTYPE: tl.constexpr):
    """w_j x_j + w_{j + 4} x_{j + 4} of each word in fp32, w = (q - zero) * scale rounded to
    DTYPE (``pair``: the two x as ``_x_pairs`` makes them; ``s`` in DTYPE)."""
    scale = s.to(tl.float32)
    w_lo = ((((words >> (4 * j)) & 0xF).to(tl.float32) + minus_zero) * scale).to(DTYPE)
    w_hi = ((((words >> (4 * j + 16)) & 0xF).to(tl.float32) + minus_zero) * scale).to(DTYPE)
    return (w_lo.to(tl.float32) * _half(pair, False, DTYPE)
            + w_hi.to(tl.float32) * _half(pair, True, DTYPE))  # fmt: skip


@triton.jit
def _row_plain(words, xa, xb, xc, xd, s, acc, nz, DTYPE: tl.constexpr,
               SCALE_AFTER: tl.constexpr = False):  # fmt: skip
    """``_row_asm`` by plain ops (the interpreter): the dot of each lane's 4 words with their
    scaled, rounded weights (``SCALE_AFTER``: with q - zero, then times the scale in fp32),
    added at the lane's first element (w % 4 == 0)."""
    minus_zero = nz.to(tl.float32) + magic_of(DTYPE)  # -zero
    if SCALE_AFTER:
        part = _pair_dot(words, xa, 0, minus_zero, DTYPE)
        part += _pair_dot(words, xb, 1, minus_zero, DTYPE)
        part += _pair_dot(words, xc, 2, minus_zero, DTYPE)
        part += _pair_dot(words, xd, 3, minus_zero, DTYPE)
        part = part * s.to(tl.float32)
    else:
        part = _scaled_pair_dot(words, xa, 0, minus_zero, s, DTYPE)
        part += _scaled_pair_dot(words, xb, 1, minus_zero, s, DTYPE)
        part += _scaled_pair_dot(words, xc, 2, minus_zero, s, DTYPE)
        part += _scaled_pair_dot(words, xd, 3, minus_zero, s, DTYPE)
    BLOCK_N: tl.constexpr = words.shape[0]
    lanes = tl.sum(tl.reshape(part, [BLOCK_N, ROW_WORDS // 4, 4]), axis=2)  # a lane's 4 words
    first = (tl.arange(0, 4) == 0)[None, None, :]
    placed = tl.where(first, lanes[:, :, None], 0.0)
    return acc + tl.reshape(placed, [BLOCK_N, ROW_WORDS])


@triton.jit
def _row_x_pairs(x_ptrs, shape, ASM: tl.constexpr):
    """``_x_pairs`` of the tile's words broadcast to the words' ``shape``; with ASM loaded by
    PTX in the words' layout (Triton lays a [128] load out on its own at some tiles and converts
    it through shared memory: BLOCK_N 16 at 4 warps), one load of a lane's x for all its rows
    (the same pure PTX on the same addresses)."""
    if not ASM:
        xa, xb, xc, xd = _x_pairs(x_ptrs)
        xa = tl.broadcast_to(xa[None, :], shape)
        xb = tl.broadcast_to(xb[None, :], shape)
        xc = tl.broadcast_to(xc[None, :], shape)
        xd = tl.broadcast_to(xd[None, :], shape)
        return xa, xb, xc, xd
    addresses = tl.broadcast_to(x_ptrs.to(tl.int64)[None, :], shape)
    pairs = tl.inline_asm_elementwise(
        _X_ASM, _X_CONSTRAINTS, args=[addresses],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4,
    )  # fmt: skip
    return pairs[0], pairs[1], pairs[2], pairs[3]


@triton.jit
def _row_tile_loads(q_ptrs, x_ptrs, s_ptr, z_ptr, rows, offs_w, k0, stride_sn, stride_zn,
                    HAS_ZEROS: tl.constexpr, ASM: tl.constexpr, GROUP_WORDS: tl.constexpr,
                    DTYPE: tl.constexpr):  # fmt: skip
    """(words, scales, -(magic + zero), the 4 x pair tensors) of the K tile at k0."""
    words, s, nz = _row_weight_loads(q_ptrs, s_ptr, z_ptr, rows, offs_w, k0, stride_sn,
                                     stride_zn, HAS_ZEROS, ASM, GROUP_WORDS, DTYPE)  # fmt: skip
    xa, xb, xc, xd = _row_x_pairs(x_ptrs + (k0 // 8) * 2, words.shape, ASM)
    return words, s, nz, xa, xb, xc, xd


@triton.jit
def _row_weight_loads(q_ptrs, s_ptr, z_ptr, rows, offs_w, k0, stride_sn, stride_zn,
                      HAS_ZEROS: tl.constexpr, ASM: tl.constexpr, GROUP_WORDS: tl.constexpr,
                      DTYPE: tl.constexpr):  # fmt: skip
    """(words, scales, -(magic + zero)) of the K tile at k0: what comes from DRAM."""
    words = tl.load(q_ptrs + k0 // 8)
    s, nz = _row_scales(s_ptr, z_ptr, rows, offs_w, k0, stride_sn, stride_zn, HAS_ZEROS, ASM,
                        GROUP_WORDS, DTYPE)  # fmt: skip
    return words, s, nz


@triton.jit
def _row_scales(s_ptr, z_ptr, rows, offs_w, k0, stride_sn, stride_zn, HAS_ZEROS: tl.constexpr,
                ASM: tl.constexpr, GROUP_WORDS: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """(scales, -(magic + zero)) of the K tile at k0 in the words' layout [rows, 128]."""
    groups = (k0 // 8 + offs_w) // GROUP_WORDS  # [128]: a word's group
    s_ptrs = s_ptr + rows[:, None] * stride_sn + groups[None, :]
    s = _row_scalar(s_ptrs, ASM).to(DTYPE)
    if HAS_ZEROS:  # -(magic + zero): exact in DTYPE (integer zeros < 16)
        z_ptrs = z_ptr + rows[:, None] * stride_zn + groups[None, :]
        nz = (-(_row_scalar(z_ptrs, ASM).to(tl.float32) + magic_of(DTYPE))).to(DTYPE)
    else:
        nz = tl.full([rows.shape[0], ROW_WORDS], -(magic_of(DTYPE) + 8), DTYPE)
    return s, nz


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _row_xsum(xa, xb, xc, xd):
    """Each lane's chunk's sum of x over the K tile, fp32 at the lane's first element
    (``_xsum_asm``; the same for every row, so one a lane: a pure PTX on the same values)."""
    return tl.inline_asm_elementwise(
        _XSUM_ASM, _XSUM_CONSTRAINTS, args=[xa, xb, xc, xd], dtype=tl.float32, is_pure=True,
        pack=4,
    )  # fmt: skip


@triton.jit
def _row_tile_math(words, xa, xb, xc, xd, s, acc, nz, HAS_ZEROS: tl.constexpr,
                   ASM: tl.constexpr, DTYPE: tl.constexpr,
                   SCALE_AFTER: tl.constexpr = False, XSUM: tl.constexpr = False):  # fmt: skip
    """``acc`` after one K tile's MMAs (``_row_asm``; ``_row_xsum_asm`` with XSUM;
    ``_row_plain`` without ASM, XSUM's sums by the scale after's plain ops: the same values
    summed otherwise)."""
    BF16: tl.constexpr = DTYPE == tl.bfloat16
    if not ASM:
        return _row_plain(words, xa, xb, xc, xd, s, acc, nz, DTYPE, SCALE_AFTER or XSUM)
    elif XSUM:
        tl.static_assert(BF16, "XSUM takes bf16 x")
        xs = _row_xsum(xa, xb, xc, xd)
        if HAS_ZEROS:
            return tl.inline_asm_elementwise(
                _ASM_XSUM_ZEROS, _CONSTRAINTS_XSUM_ZEROS, args=[words, xa, xb, xc, xd, s, acc,
                                                               xs, nz],
                dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            _ASM_XSUM, _CONSTRAINTS_XSUM, args=[words, xa, xb, xc, xd, s, acc, xs],
            dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip
    elif HAS_ZEROS and SCALE_AFTER:
        return tl.inline_asm_elementwise(
            _ASM_BF16_ZEROS_AFTER if BF16 else _ASM_FP16_ZEROS_AFTER, _CONSTRAINTS_ZEROS,
            args=[words, xa, xb, xc, xd, s, acc, nz], dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip
    elif HAS_ZEROS:
        return tl.inline_asm_elementwise(
            _ASM_BF16_ZEROS if BF16 else _ASM_FP16_ZEROS, _CONSTRAINTS_ZEROS,
            args=[words, xa, xb, xc, xd, s, acc, nz], dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip
    elif SCALE_AFTER:
        return tl.inline_asm_elementwise(
            _ASM_BF16_AFTER if BF16 else _ASM_FP16_AFTER, _CONSTRAINTS,
            args=[words, xa, xb, xc, xd, s, acc], dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            _ASM_BF16 if BF16 else _ASM_FP16, _CONSTRAINTS,
            args=[words, xa, xb, xc, xd, s, acc], dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip


@triton.jit
def _row_mma_k_loop(
    x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, k_lo, k_hi, stride_xm, stride_qn, stride_sn,
    stride_zn, HAS_ZEROS: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUP_WORDS: tl.constexpr, K_STAGES: tl.constexpr = 1,
    STEP_TILES: tl.constexpr = 1, SCALE_AFTER: tl.constexpr = False,
    XSUM: tl.constexpr = False, AHEAD: tl.constexpr = False, all_ones=-1,
    NUM_WARPS: tl.constexpr = 1,
):  # fmt: skip
    """The [1, BLOCK_N] fp32 sums of k_lo <= k < k_hi of one row (4-bit weights, 16-bit x, K a
    multiple of 1024; ``GROUP_WORDS``: words a group, a multiple of 4): per 1024-deep tile a
    warp's MMAs on each of its rows (module docstring). ``K_STAGES`` > 1: the words pipelined
    that many tiles ahead (``tl.range``'s num_stages; the PTX loads of x and the scales are
    not). ``STEP_TILES``: tiles a step, every load of the step (words, scales, x) issued
    before its math: that many tiles' memory latency met at once (the split's K a multiple of
    1024 * STEP_TILES). ``SCALE_AFTER``: the scale after the MMAs (``GROUP_WORDS`` a multiple
    of 16); ``XSUM`` (bf16) the zero after them too, by the chunks' x-sums. ``AHEAD``: of a
    step only the words, scales and zeros loaded first (the DRAM latency of STEP_TILES tiles
    met at once), each tile's x (an L1 hit) loaded at its math: x's registers held for one
    tile, not STEP_TILES (one stage). ptxas sinks a load to just before its first use, so each
    tile's words are tied to every load of the step (OR-ed with them AND ``~all_ones``, zero
    at run time, which it cannot see): all are issued before the step's first MMA."""
    tl.static_assert(not (SCALE_AFTER or XSUM) or GROUP_WORDS % 16 == 0,
                     "SCALE_AFTER / XSUM need groups of a multiple of 128 values")  # fmt: skip
    tl.static_assert(not AHEAD or K_STAGES == 1, "AHEAD takes one stage")
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    BLOCK_K: tl.constexpr = ROW_WORDS * 8
    offs_w = tl.arange(0, ROW_WORDS)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_w[None, :]  # [BLOCK_N, 128]
    x_row = (x_ptr + tl.sum(offs_m).to(tl.int64) * stride_xm).to(tl.pointer_type(tl.int64))
    x_ptrs = x_row + offs_w * 2  # [128]: each word's x_0 .. x_3 (x_4 .. x_7 the next)
    acc = tl.zeros([BLOCK_N, ROW_WORDS], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, STEP_TILES * BLOCK_K, num_stages=K_STAGES):
        loaded = []
        if AHEAD:  # the step's weights, then each tile's x with its math
            for t in tl.static_range(STEP_TILES):
                loaded = loaded + [_row_weight_loads(
                    q_ptrs, s_ptr, z_ptr, rows, offs_w, k0 + t * BLOCK_K, stride_sn, stride_zn,
                    HAS_ZEROS, ASM, GROUP_WORDS, DTYPE,
                )]  # fmt: skip
            tie = tl.zeros([BLOCK_N, ROW_WORDS], dtype=tl.int32)
            for t in tl.static_range(STEP_TILES):
                words, s, nz = loaded[t]
                tie = tie | words | s.to(tl.int16, bitcast=True).to(tl.int32)
                if HAS_ZEROS:
                    tie = tie | nz.to(tl.int16, bitcast=True).to(tl.int32)
            # over a thread's rows too (rows i and i + num_warps: the reshape keeps them in-thread)
            ROWS: tl.constexpr = BLOCK_N // NUM_WARPS
            tie = tl.reduce(tl.reshape(tie, [ROWS, NUM_WARPS, ROW_WORDS]), 0, _or)
            tie = tl.reshape(tl.broadcast_to(tie[None, :, :], [ROWS, NUM_WARPS, ROW_WORDS]),
                             [BLOCK_N, ROW_WORDS])  # fmt: skip
            tie = tie & ~all_ones  # zero
            for t in tl.static_range(STEP_TILES):
                words, s, nz = loaded[t]
                words = words | tie
                xa, xb, xc, xd = _row_x_pairs(x_ptrs + ((k0 + t * BLOCK_K) // 8) * 2,
                                              words.shape, ASM)  # fmt: skip
                acc = _row_tile_math(words, xa, xb, xc, xd, s, acc, nz, HAS_ZEROS, ASM, DTYPE,
                                     SCALE_AFTER, XSUM)  # fmt: skip
        else:
            for t in tl.static_range(STEP_TILES):  # the step's loads, then its math
                loaded = loaded + [_row_tile_loads(
                    q_ptrs, x_ptrs, s_ptr, z_ptr, rows, offs_w, k0 + t * BLOCK_K, stride_sn,
                    stride_zn, HAS_ZEROS, ASM, GROUP_WORDS, DTYPE,
                )]  # fmt: skip
            for t in tl.static_range(STEP_TILES):
                words, s, nz, xa, xb, xc, xd = loaded[t]
                acc = _row_tile_math(words, xa, xb, xc, xd, s, acc, nz, HAS_ZEROS, ASM, DTYPE,
                                     SCALE_AFTER, XSUM)  # fmt: skip
    return tl.reshape(tl.sum(acc, axis=1), [BLOCK_M, BLOCK_N])


@triton.jit
def _per_element_words(ptrs, ASM: tl.constexpr):
    """The int32 words at ``ptrs`` (one address an element) in the words' layout: by PTX, plain
    loads without ASM."""
    if not ASM:
        return tl.load(ptrs)
    return tl.inline_asm_elementwise(_LOAD_WORDS, "=r,=r,=r,=r,l,l,l,l", args=[ptrs.to(tl.int64)],
                                     dtype=tl.int32, is_pure=True, pack=4)  # fmt: skip


@triton.jit
def _per_element_halves(ptrs, ASM: tl.constexpr):
    """The 16-bit floats at ``ptrs`` (one address an element) in the words' layout: by PTX (a
    tl.load of them is an anchor Triton may lay out its own way), plain loads without ASM."""
    if not ASM:
        return tl.load(ptrs)
    raw = tl.inline_asm_elementwise(_LOAD_HALVES, "=r,=r,l,l,l,l", args=[ptrs.to(tl.int64)],
                                    dtype=tl.int16, is_pure=True, pack=4)  # fmt: skip
    return raw.to(ptrs.dtype.element_ty, bitcast=True)


@triton.jit
def _row_mma_strided_k_loop(
    x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, k_lo, k_hi, stride_xm, stride_qn, stride_sn,
    stride_zn, all_ones, HAS_ZEROS: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUP_WORDS: tl.constexpr,
):  # fmt: skip
    """``_row_mma_k_loop`` (one tile a step, the weights scaled before the MMAs) with lane l
    holding words l, 32 + l, 64 + l, 96 + l of its row's K tile instead
    of 4l .. 4l + 3: each of a warp's loads of x reads 512 contiguous bytes (4 L1 wavefronts,
    not 16: the contiguous layout's x loads cost a W4A16 GEMM more than its words, session
    35), each of its word loads 128. The tile keeps ROW_LAYOUT (lane l columns 4l .. 4l + 3,
    from a contiguous load masked off at run time) and column 4l + i stands for word 32 i + l,
    every load by PTX on its own addresses. The MMA's chunk n is words 4n .. 4n + 3 of
    each 32-word quarter (contiguous: any group of 32 values holds one); a lane's 4 words lie
    in 4 groups, so each takes its own scale and zero (``_row_asm``'s ``per_word``)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    BF16: tl.constexpr = DTYPE == tl.bfloat16
    BLOCK_K: tl.constexpr = ROW_WORDS * 8
    offs_w = tl.arange(0, ROW_WORDS)
    word = 32 * (offs_w % 4) + offs_w // 4  # column 4l + i (lane l's i-th): word 32 i + l
    q_row = q_ptr + rows[:, None] * stride_qn
    # the layout's anchor: a contiguous load (Triton's 16-byte vectors, ROW_LAYOUT) masked off
    # at run time by a bound the compiler cannot see (all_ones is -1): zeros, no memory read
    anchor = tl.load(q_row + offs_w[None, :], mask=offs_w[None, :] < all_ones, other=0)
    q_ptrs = q_row + word[None, :]  # [BLOCK_N, 128]
    x_row = (x_ptr + tl.sum(offs_m).to(tl.int64) * stride_xm).to(tl.pointer_type(tl.int64))
    x_ptrs = x_row + word * 2
    acc = tl.zeros([BLOCK_N, ROW_WORDS], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        words = _per_element_words(q_ptrs + k0 // 8, ASM) | anchor
        groups = (k0 // 8 + word) // GROUP_WORDS
        s = _per_element_halves(s_ptr + rows[:, None] * stride_sn + groups[None, :], ASM)
        s = s.to(DTYPE)
        if HAS_ZEROS:  # -(magic + zero): exact in DTYPE (integer zeros < 16)
            z = _per_element_halves(z_ptr + rows[:, None] * stride_zn + groups[None, :], ASM)
            nz = (-(z.to(tl.float32) + magic_of(DTYPE))).to(DTYPE)
        else:
            nz = tl.full(words.shape, -(magic_of(DTYPE) + 8), DTYPE)
        xa, xb, xc, xd = _row_x_pairs(x_ptrs + (k0 // 8) * 2, words.shape, ASM)
        if not ASM:
            acc = _row_plain_per_word(words, xa, xb, xc, xd, s, acc, nz, DTYPE)
        elif HAS_ZEROS:
            acc = tl.inline_asm_elementwise(
                _ASM_BF16_ZEROS_WORD if BF16 else _ASM_FP16_ZEROS_WORD, _CONSTRAINTS_ZEROS,
                args=[words, xa, xb, xc, xd, s, acc, nz], dtype=tl.float32, is_pure=True,
                pack=4,
            )  # fmt: skip
        else:
            acc = tl.inline_asm_elementwise(
                _ASM_BF16_WORD if BF16 else _ASM_FP16_WORD, _CONSTRAINTS,
                args=[words, xa, xb, xc, xd, s, acc], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
    return tl.reshape(tl.sum(acc, axis=1), [BLOCK_M, BLOCK_N])


@triton.jit
def _row_plain_per_word(words, xa, xb, xc, xd, s, acc, nz, DTYPE: tl.constexpr):
    """``_row_plain`` with each word's own scale and zero (the interpreter's STRIDED)."""
    minus_zero = nz.to(tl.float32) + magic_of(DTYPE)  # -zero
    part = _scaled_pair_dot(words, xa, 0, minus_zero, s, DTYPE)
    part += _scaled_pair_dot(words, xb, 1, minus_zero, s, DTYPE)
    part += _scaled_pair_dot(words, xc, 2, minus_zero, s, DTYPE)
    part += _scaled_pair_dot(words, xd, 3, minus_zero, s, DTYPE)
    return acc + part
