"""The one-row W4A16 K loop on tensor cores without shared memory (``QUAD_MMA``, a variant of
``int_quant._permuted_k_loop``'s multiply-adds; ``int_quant.wna16_config`` says where it stands).

A [BLOCK_N, 16] tile of int32 words (16 words = 128 4-bit values of each row) loads as 16-byte
vectors: Triton's coalesced layout gives each thread 4 adjacent words of one row, the 4 threads
of a quad (lanes 4g .. 4g + 3) one row's 16 words, and a warp 8 rows (``QUAD_LAYOUT``; the
sm_90 compile test pins it). That is the register layout of an ``mma.m16n8k16`` B operand with
the 8 rows as its 8 columns: lane 4g + c holds k = 2c, 2c + 1, 2c + 8, 2c + 9 of column g. So a
thread's 4 words go into 8 MMAs as they sit, with no layout conversion (the dots of
``int_quant_packed_dot`` convert through shared memory): per word, 3 shifts and 4 AND-ORs make
the 16-bit floats (magic + q) pairwise (values j and j + 4 in one register, ``_nibble_pairs``),
4 packed FMAs take off magic + zero (q - zero, exact), and 2 MMAs multiply them by x: 13
instructions for 8 weights, against the multiply-add loops' ~25 (``int_quant_small_magic``).

x is the MMAs' A operand, the same in all 16 rows: a thread passes the x of its own words,
paired as its weights are ((x_j, x_{j + 4}) for j = 0..3, from two 64-bit loads a word), and
since every quad covers the same k a lane's A registers meet the weights at their k in every
column. The MMAs sum over the quad's 128 values: D[g][n] is row n's dot over the tile for every
g, and lane 4g + c receives rows 2c and 2c + 1 (its D registers 0, 1; 2, 3 repeat them). The
tile's result is scaled in fp32 (the tile lies in one group: the group size is a multiple of
128) by the scales of those rows, fetched from lanes 8c and 8c + 4 (``shfl.sync``), in the
same PTX block, so every register keeps its meaning: element (i, w) of the accumulator holds
row ``quad_row(i, w)`` (``quad_rows``), and the row of element i is read at w = 4 (i % 8 // 2) +
i % 2 (``_rows_of_quads``).

Precision: q - zero is exact in bf16 / fp16, each product exact in the MMA's fp32, summed in
fp32 over 128 values and scaled once a tile: at least as exact as the reference (the weight
rounded to x's dtype before a bf16 GEMM).

The MMAs and the shuffles are inline PTX (``tl.inline_asm_elementwise``, a thread's 4 words an
instance; sm_80+): NVIDIA only. Triton's interpreter takes the same values from ``_quad_plain``
(the rows' dots and their rearrangement by ``tl.gather``), so the interpreter tests the loop's
bookkeeping; the PTX is checked against the reference on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atom_kernels.backends.triton.int_quant_packed_dot import magic_of

# The words tile's register layout the PTX relies on (Triton's coalesced layout of a
# [BLOCK_N, 16] int32 load with 16-byte aligned rows, BLOCK_N a multiple of 8 * num_warps).
QUAD_LAYOUT = "sizePerThread = [1, 4], threadsPerWarp = [8, 4]"
QUAD_WORDS = tl.constexpr(16)  # words of a row in a K tile (BLOCK_K = 128 at 4 bits)


def _quad_asm(bf16: bool, zeros: bool) -> str:
    """PTX of one thread's 4 words: outputs $0, $1 the fp32 accumulator of its rows 2c, 2c + 1
    of the warp's 8 after this tile, $2, $3 zero; inputs $4..$7 the words, $8..$23 the x pairs
    (x_0, x_4), (x_1, x_5), (x_2, x_6), (x_3, x_7) of each word (4 registers each), $24..$27
    the row's scale (fp32, the same in all 4), $28..$31 the accumulator before; with ``zeros``
    $32, $33 -(magic + zero) as two 16-bit floats (else the symmetric zero 8, an immediate).

    One A operand serves both MMAs of a word, {(x_0, x_4), (x_2, x_6), (x_1, x_5), (x_3, x_7)}
    (no register moves: ptxas wants it in 4 consecutive registers): rows g meet values 0, 4, 1,
    5 in the first MMA (accumulator d), rows g + 8 values 2, 6, 3, 7 in the second (e); the
    other half of each is never read. A row's tile sum is d's row g plus e's row g + 8."""
    magic = "0x43004300" if bf16 else "0x64006400"
    one = "0x3F803F80" if bf16 else "0x3C003C00"
    nz = "$32" if zeros else ("0xC308C308" if bf16 else "0xE408E408")  # -(magic + 8)
    kind = "bf16" if bf16 else "f16"
    fma = f"fma.rn.{kind}x2"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    lines = [
        "{",
        ".reg .b32 t0, t1, t2, t3, u, one, nz, lane, src0, src1;",
        ".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3, s0, s1;",
        f"mov.b32 one, {one};",
        f"mov.b32 nz, {nz};",
    ]
    lines += [f"mov.f32 {r}, 0f00000000;" for r in ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3")]
    for i in range(4):
        word = f"${4 + i}"
        xa, xb, xc, xd = (f"${8 + 4 * p + i}" for p in range(4))
        lines.append(f"lop3.b32 t0, {word}, 0x000F000F, {magic}, 0xEA;")  # (w & m) | magic
        for j in (1, 2, 3):
            lines += [f"shr.u32 u, {word}, {4 * j};",
                      f"lop3.b32 t{j}, u, 0x000F000F, {magic}, 0xEA;"]  # fmt: skip
        lines += [f"{fma} t{j}, t{j}, one, nz;" for j in range(4)]  # q - zero, exact
        lines += [
            f"{mma} {{d0, d1, d2, d3}}, {{{xa}, {xc}, {xb}, {xd}}}, {{t0, t1}}, "
            "{d0, d1, d2, d3};",
            f"{mma} {{e0, e1, e2, e3}}, {{{xa}, {xc}, {xb}, {xd}}}, {{t2, t3}}, "
            "{e0, e1, e2, e3};",
        ]
    lines += [
        "add.f32 d0, d0, e2;",
        "add.f32 d1, d1, e3;",
        "mov.u32 lane, %laneid;",
        "and.b32 src0, lane, 3;",
        "shl.b32 src0, src0, 3;",  # lane 8c: row 2c's quad
        "add.u32 src1, src0, 4;",  # lane 8c + 4: row 2c + 1's
        "shfl.sync.idx.b32 s0, $24, src0, 0x1f, 0xffffffff;",
        "shfl.sync.idx.b32 s1, $24, src1, 0x1f, 0xffffffff;",
        "fma.rn.f32 $0, d0, s0, $28;",
        "fma.rn.f32 $1, d1, s1, $29;",
        "mov.f32 $2, 0f00000000;",
        "mov.f32 $3, 0f00000000;",
        "}",
    ]
    return "\n".join(lines)


_ASM = {
    (bf16, zeros): tl.constexpr(_quad_asm(bf16, zeros)) for bf16 in (True, False)
    for zeros in (True, False)
}  # fmt: skip
_ASM_BF16 = _ASM[True, False]
_ASM_BF16_ZEROS = _ASM[True, True]
_ASM_FP16 = _ASM[False, False]
_ASM_FP16_ZEROS = _ASM[False, True]
_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 20 + ["f"] * 8))
_CONSTRAINTS_ZEROS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 20 + ["f"] * 8 + ["r"] * 2))


_LOAD16 = tl.constexpr(
    "{\n.reg .b16 h;\nld.global.nc.b16 h, [$2];\nmov.b32 $0, {h, h};\nmov.b32 $1, {h, h};\n}"
)
_LOAD32 = tl.constexpr(
    "ld.global.nc.b32 $0, [$4];\nmov.b32 $1, $0;\nmov.b32 $2, $0;\nmov.b32 $3, $0;"
)


@triton.jit
def _row_scalar(ptrs, ASM: tl.constexpr):
    """The values at ``ptrs`` ([BLOCK_N, 16], one address a row: a row's scale or zero), in the
    words' layout: by PTX one load a thread's 4 words (a tl.load of them is an anchor Triton
    may lay out otherwise and convert through shared memory; Triton 3.6 does for 128 rows);
    plain loads without ASM."""
    if not ASM:
        return tl.load(ptrs)
    DT: tl.constexpr = ptrs.dtype.element_ty
    tl.static_assert(DT.primitive_bitwidth == 16 or DT.primitive_bitwidth == 32,
                     "_row_scalar loads 16- or 32-bit values")  # fmt: skip
    addresses = ptrs.to(tl.int64)
    if DT.primitive_bitwidth == 16:
        raw = tl.inline_asm_elementwise(_LOAD16, "=r,=r,l,l,l,l", args=[addresses],
                                        dtype=tl.int16, is_pure=True, pack=4)  # fmt: skip
    else:
        raw = tl.inline_asm_elementwise(_LOAD32, "=r,=r,=r,=r,l,l,l,l", args=[addresses],
                                        dtype=tl.int32, is_pure=True, pack=4)  # fmt: skip
    return raw.to(DT, bitcast=True)


@triton.jit
def quad_rows(BLOCK_N: tl.constexpr):
    """[BLOCK_N, 16] int32: the tile row (0 .. BLOCK_N - 1) whose result element (i, w) of the
    accumulator holds: lane 4 (i % 8) + w // 4 receives rows 2 (w // 4) and 2 (w // 4) + 1 of
    its warp's 8 in its registers w % 4 = 0, 1 (2, 3 hold zero)."""
    i = tl.arange(0, BLOCK_N)[:, None]
    w = tl.arange(0, QUAD_WORDS)[None, :]
    return (i // 8) * 8 + 2 * (w // 4) + w % 2


@triton.jit
def _rows_of_quads(acc, BLOCK_N: tl.constexpr):
    """[BLOCK_N] fp32: row i of the tile, read from the accumulator element that holds it
    (w = 4 (i % 8 // 2) + i % 2, where ``quad_rows`` is i)."""
    i = tl.arange(0, BLOCK_N)[:, None]
    w = tl.arange(0, QUAD_WORDS)[None, :]
    mine = w == 4 * (i % 8 // 2) + i % 2
    return tl.sum(tl.where(mine, acc, 0.0), axis=1)


@triton.jit
def _x_pairs(x_ptrs):
    """x at the tile's words as the MMAs' pairs: 4 [16] int32 (x_j, x_{j + 4}) of each word,
    j = 0..3, from two 64-bit loads a word (``x_ptrs``: each word's x_0 .. x_3, int64)."""
    lo = tl.load(x_ptrs)  # x_0 .. x_3
    hi = tl.load(x_ptrs + 1)  # x_4 .. x_7
    x01 = lo.to(tl.int32)
    x23 = (lo >> 32).to(tl.int32)
    x45 = hi.to(tl.int32)
    x67 = (hi >> 32).to(tl.int32)
    xa = (x01 & 0xFFFF) | (x45 << 16)
    xb = ((x01 >> 16) & 0xFFFF) | (x45 & -65536)
    xc = (x23 & 0xFFFF) | (x67 << 16)
    xd = ((x23 >> 16) & 0xFFFF) | (x67 & -65536)
    return xa, xb, xc, xd


@triton.jit
def _half(pair, high: tl.constexpr, DTYPE: tl.constexpr):
    """The low / high 16-bit float of the int32 ``pair``, in fp32."""
    bits = (pair >> 16) if high else pair
    return bits.to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)


@triton.jit
def _pair_dot(words, pair, j: tl.constexpr, minus_zero, DTYPE: tl.constexpr):
    """(q_j - zero) x_j + (q_{j + 4} - zero) x_{j + 4} of each word, in fp32 (``pair``: the
    two x as ``_x_pairs`` makes them)."""
    q_lo = ((words >> (4 * j)) & 0xF).to(tl.float32) + minus_zero
    q_hi = ((words >> (4 * j + 16)) & 0xF).to(tl.float32) + minus_zero
    return q_lo * _half(pair, False, DTYPE) + q_hi * _half(pair, True, DTYPE)


@triton.jit
def _quad_plain(words, xa, xb, xc, xd, s, acc, nz, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_quad_asm`` by plain ops (the interpreter): each row's dot over the tile, placed as the
    MMAs place it (``quad_rows``) and scaled by that row's scale."""
    minus_zero = nz.to(tl.float32) + magic_of(DTYPE)  # -zero
    part = tl.zeros(words.shape, tl.float32)
    part += _pair_dot(words, xa, 0, minus_zero, DTYPE)
    part += _pair_dot(words, xb, 1, minus_zero, DTYPE)
    part += _pair_dot(words, xc, 2, minus_zero, DTYPE)
    part += _pair_dot(words, xd, 3, minus_zero, DTYPE)
    dots = tl.broadcast_to(tl.sum(part, axis=1)[:, None], words.shape)
    rows = quad_rows(BLOCK_N)
    held = (tl.arange(0, QUAD_WORDS) % 4 < 2)[None, :]  # registers 2, 3: zero
    return tl.where(held, acc + tl.gather(dots, rows, axis=0) * tl.gather(s, rows, axis=0), 0.0)


@triton.jit
def _quad_tile(words, acc, k0, x_ptrs, s_ptr, z_ptr, rows, group_size, stride_sn, stride_zn,
               HAS_ZEROS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
               GROUP_TILES: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """``acc`` after the K tile at k0 (``words``: its [BLOCK_N, 16] words)."""
    BLOCK_K: tl.constexpr = QUAD_WORDS * 8
    if GROUP_TILES > 0:
        group = (k0 // BLOCK_K) // GROUP_TILES
    else:
        group = k0 // group_size
    s_ptrs = tl.broadcast_to((s_ptr + rows * stride_sn + group)[:, None], words.shape)
    s = _row_scalar(s_ptrs, ASM).to(tl.float32)
    if HAS_ZEROS:  # -(magic + zero): exact in DTYPE (integer zeros < 16)
        z_ptrs = tl.broadcast_to((z_ptr + rows * stride_zn + group)[:, None], words.shape)
        nz = (-(_row_scalar(z_ptrs, ASM).to(tl.float32) + magic_of(DTYPE))).to(DTYPE)
    else:
        nz = tl.full(words.shape, -(magic_of(DTYPE) + 8), DTYPE)
    xa, xb, xc, xd = _x_pairs(x_ptrs + (k0 // 8) * 2)
    xa = tl.broadcast_to(xa[None, :], words.shape)
    xb = tl.broadcast_to(xb[None, :], words.shape)
    xc = tl.broadcast_to(xc[None, :], words.shape)
    xd = tl.broadcast_to(xd[None, :], words.shape)
    if not ASM:
        return _quad_plain(words, xa, xb, xc, xd, s, acc, nz, DTYPE, BLOCK_N)
    elif HAS_ZEROS:
        return tl.inline_asm_elementwise(
            _ASM_BF16_ZEROS if DTYPE == tl.bfloat16 else _ASM_FP16_ZEROS, _CONSTRAINTS_ZEROS,
            args=[words, xa, xb, xc, xd, s, acc, nz], dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            _ASM_BF16 if DTYPE == tl.bfloat16 else _ASM_FP16, _CONSTRAINTS,
            args=[words, xa, xb, xc, xd, s, acc], dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip


@triton.jit
def _quad_mma_k_loop(
    x_ptr, q_ptr, s_ptr, z_ptr, rows, offs_m, k_lo, k_hi, group_size, stride_xm, stride_qn,
    stride_sn, stride_zn, HAS_ZEROS: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, K_STAGES: tl.constexpr = 1, GROUP_TILES: tl.constexpr = 0,
    STEP_TILES: tl.constexpr = 1,
):  # fmt: skip
    """The [1, BLOCK_N] fp32 sums of k_lo <= k < k_hi of one row (4-bit weights, 16-bit x, K a
    multiple of 128, the group size too): per 128-deep tile, the quads' MMAs (module
    docstring), scaled a tile. ``K_STAGES`` > 1: the words pipelined that many tiles ahead
    (``tl.range``'s num_stages). ``GROUP_TILES``: K tiles a group (a constant divisor), 0:
    the group size divides at run time. ``STEP_TILES``: adjacent tiles a step, their loads
    issued together (64 * STEP_TILES contiguous bytes of each row at once; the split's K a
    multiple of 128 * STEP_TILES)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    BLOCK_K: tl.constexpr = QUAD_WORDS * 8
    offs_kp = tl.arange(0, QUAD_WORDS)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_kp[None, :]  # [BLOCK_N, 16]
    x_row = (x_ptr + tl.sum(offs_m).to(tl.int64) * stride_xm).to(tl.pointer_type(tl.int64))
    x_ptrs = x_row + offs_kp * 2  # [16]: each word's x_0 .. x_3 (x_4 .. x_7 the next)
    acc = tl.zeros([BLOCK_N, QUAD_WORDS], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, STEP_TILES * BLOCK_K, num_stages=K_STAGES):
        tiles = []
        for t in tl.static_range(STEP_TILES):  # every load of the step before any math
            tiles = tiles + [tl.load(q_ptrs + k0 // 8 + t * QUAD_WORDS)]
        for t in tl.static_range(STEP_TILES):
            acc = _quad_tile(tiles[t], acc, k0 + t * BLOCK_K, x_ptrs, s_ptr, z_ptr, rows,
                             group_size, stride_sn, stride_zn, HAS_ZEROS, ASM, BLOCK_N,
                             GROUP_TILES, DTYPE)  # fmt: skip
    return tl.reshape(_rows_of_quads(acc, BLOCK_N), [BLOCK_M, BLOCK_N])
