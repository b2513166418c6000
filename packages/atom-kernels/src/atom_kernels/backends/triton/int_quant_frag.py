"""WNA16 decode on the fragment layout (``atom_kernels.ops.int_quant_frag``): 1-8 tokens, 4-bit
weights, 16-bit x, on ``mma.sync.m16n8k16`` with the weights as A (16 rows) and the tokens as B's
8 columns, so every product an MMA makes is one the GEMM needs (at one token, one column of 8).

A program is one row block (16 rows) over a K split; its tile is [R, 128] int32 words, R steps of
64 k (``ROWS_PER_WARP`` a warp), laid out as Triton lays out a 16-byte-aligned [R, 128] load: lane
l holds words 4l .. 4l + 3 of its tile row (``int_quant_row_mma.ROW_LAYOUT``), which the fragment
layout makes that lane's A operands of the step's 4 MMAs: a warp's load is 512 contiguous bytes,
one MMA a word. A lane's x is its token's (lane // 4) 16 k at 16 (l % 4): two 16-byte loads, the
same bytes for the 8 lanes of one l % 4, where ``int_quant_row_mma`` reads 64 bytes of x a lane
a row.

Per word: 3 shifts and 4 AND-ORs (magic + q, two values a register), 4 packed FMAs (q - zero,
exact), one MMA; a step's 4 MMAs start from zero and the step's sum is scaled by the row's scale
in fp32 (groups of a multiple of 64 k: a step is in one group), like ``int_quant_row_mma``'s
SCALE_AFTER (not the reference's rounding of each scaled weight to x's dtype).

The accumulator is the MMAs' D in the words' layout: lane (g, c)'s 4 elements are D[g][2c],
D[g][2c + 1], D[g + 8][2c], D[g + 8][2c + 1] (rows g, g + 8 of the block, tokens 2c, 2c + 1);
the epilogue sums the tile rows and permutes D to [tokens, rows]. Triton's interpreter computes
the same D by plain ops (``_frag_plain``): it checks the addressing, the layout and the epilogue;
the PTX is checked on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton.common import as_rows, is_interpreted, num_sms, zeroed_counters
from atom_kernels.backends.triton.int_quant_quad_mma import _half
from atom_kernels.backends.triton.split_k import _split_k_sum_flat
from atom_kernels.ops.int_quant_frag import FRAG_ROWS, FRAG_STEP

FRAG_MAX_TOKENS = 8
FRAG_DTYPES = (torch.bfloat16, torch.float16)
TILE_WORDS = tl.constexpr(128)  # words of a tile row: 32 lanes x 4
BLOCK_ROWS = tl.constexpr(FRAG_ROWS)


def _frag_asm(bf16: bool, zeros: bool) -> str:
    """PTX of one lane's step: outputs $0..$3 the accumulator after it; inputs $4..$7 the words,
    $8..$11 the accumulator before, $12..$15 the lane's x (its token's 16 k as 4 64-bit words,
    zero past the tokens), $16 the scales of rows g (low half) and g + 8 (high half), with
    ``zeros`` $20 their zeros likewise (pack 4: of $16..$19 and $20..$23 the first used)."""
    magic = "0x43004300" if bf16 else "0x64006400"
    one = "0x3F803F80" if bf16 else "0x3C003C00"
    kind = "bf16" if bf16 else "f16"
    fma = f"fma.rn.{kind}x2"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    lines = [
        "{",
        ".reg .b32 u, one, nz0, nz1;",
        ".reg .b32 x0, x1, x2, x3, x4, x5, x6, x7;",
        ".reg .b32 " + ", ".join(f"t{w}{p}" for w in range(4) for p in range(4)) + ";",
        ".reg .f32 d0, d1, d2, d3, f0, f1;",
        ".reg .b16 h0, h1;",
    ]
    lines += [f"mov.b64 {{x{2 * i}, x{2 * i + 1}}}, ${12 + i};" for i in range(4)]
    lines.append(f"mov.b32 one, {one};")
    if zeros:  # -(magic + zero) of rows g (low half) and g + 8 (high half), each in both halves
        neg_one, neg_magic = ("0xBF80BF80", "0xC300C300") if bf16 else ("0xBC00BC00", "0xE400E400")
        lines += [
            f"mov.b32 nz0, {neg_one};",
            f"mov.b32 nz1, {neg_magic};",
            f"{fma} u, $20, nz0, nz1;",
            "prmt.b32 nz0, u, u, 0x1010;",
            "prmt.b32 nz1, u, u, 0x3232;",
        ]
    else:
        nz = "0xC308C308" if bf16 else "0xE408E408"  # -(magic + 8)
        lines += [f"mov.b32 nz0, {nz};", f"mov.b32 nz1, {nz};"]
    for w in range(4):  # words 0, 1: row g; 2, 3: row g + 8
        word, nz = f"${4 + w}", "nz0" if w < 2 else "nz1"
        lines.append(f"lop3.b32 t{w}0, {word}, 0x000F000F, {magic}, 0xEA;")
        for p in (1, 2, 3):
            lines += [f"shr.u32 u, {word}, {4 * p};",
                      f"lop3.b32 t{w}{p}, u, 0x000F000F, {magic}, 0xEA;"]  # fmt: skip
        lines += [f"{fma} t{w}{p}, t{w}{p}, one, {nz};" for p in range(4)]  # q - zero, exact
    lines += [f"mov.f32 d{i}, 0f00000000;" for i in range(4)]
    # MMA (jj, h): words jj (row g) and 2 + jj (row g + 8), pairs 2h, 2h + 1; x pairs 4jj + 2h ..
    for jj in range(2):
        for h in range(2):
            a = f"t{jj}{2 * h}, t{2 + jj}{2 * h}, t{jj}{2 * h + 1}, t{2 + jj}{2 * h + 1}"
            b = f"x{4 * jj + 2 * h}, x{4 * jj + 2 * h + 1}"
            lines.append(f"{mma} {{d0, d1, d2, d3}}, {{{a}}}, {{{b}}}, {{d0, d1, d2, d3}};")
    if bf16:  # a bf16's bits are an fp32's top half
        lines += ["shl.b32 u, $16, 16;", "mov.b32 f0, u;",
                  "and.b32 u, $16, 0xFFFF0000;", "mov.b32 f1, u;"]  # fmt: skip
    else:
        lines += ["mov.b32 {h0, h1}, $16;", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;"]
    lines += [
        "fma.rn.f32 $0, d0, f0, $8;",
        "fma.rn.f32 $1, d1, f0, $9;",
        "fma.rn.f32 $2, d2, f1, $10;",
        "fma.rn.f32 $3, d3, f1, $11;",
        "}",
    ]
    return "\n".join(lines)


_ASM_BF16 = tl.constexpr(_frag_asm(True, False))
_ASM_BF16_ZEROS = tl.constexpr(_frag_asm(True, True))
_ASM_FP16 = tl.constexpr(_frag_asm(False, False))
_ASM_FP16_ZEROS = tl.constexpr(_frag_asm(False, True))
_CONSTRAINTS = tl.constexpr(
    "=f,=f,=f,=f," + ",".join(["r"] * 4 + ["f"] * 4 + ["l"] * 4 + ["r"] * 4)
)
_CONSTRAINTS_ZEROS = tl.constexpr(
    "=f,=f,=f,=f," + ",".join(["r"] * 4 + ["f"] * 4 + ["l"] * 4 + ["r"] * 8)
)


@triton.jit
def _frag_plain(words, acc, x, s, z, HAS_ZEROS: tl.constexpr, DTYPE: tl.constexpr,
                R: tl.constexpr):  # fmt: skip
    """``_frag_asm`` by plain ops (the interpreter) on the same operands: the step's D per tile
    row from the lanes' words, x (lane (g, c) token g's k 16c .. 16c + 15) and scale pairs,
    scaled, added to ``acc`` in the MMAs' layout."""
    # x of token t at k 16c + 4j' + m: lanes (t, c), element j', bits 16m
    xv = tl.reshape(x, [R, 8, 4, 4])  # R, token, c, j'
    four = tl.arange(0, 4)
    xv = tl.reshape((xv[:, :, :, :, None] >> (16 * four)[None, None, None, None, :]).to(tl.int32),
                    [R, 8, 4, 2, 8])  # R, token, c, jj, v (k 16c + 8jj + v)  # fmt: skip
    xf = _half(xv, False, DTYPE)
    pairs = tl.reshape(s, [R, 8, 16])  # lane (g, c) element j: rows g, g + 8
    sg = tl.sum(tl.where(tl.arange(0, 16)[None, None, :] == 0, pairs, 0), axis=2)  # [R, 8]
    scale = tl.join(_half(sg, False, DTYPE), _half(sg, True, DTYPE))  # R, g, hi
    if HAS_ZEROS:
        zg = tl.sum(tl.where(tl.arange(0, 16)[None, None, :] == 0, tl.reshape(z, [R, 8, 16]), 0),
                    axis=2)  # fmt: skip
        zero = tl.join(_half(zg, False, DTYPE), _half(zg, True, DTYPE))
    else:
        zero = tl.full([R, 8, 2], 8.0, tl.float32)
    w5 = tl.permute(tl.reshape(words, [R, 8, 4, 2, 2]), (0, 1, 3, 2, 4))  # R, g, hi, c, jj
    eight = tl.arange(0, 8)
    d = tl.zeros([R, 8, 2, 8], tl.float32)  # R, g, hi, token
    for p in tl.static_range(8):
        v: tl.constexpr = 2 * p if p < 4 else 2 * (p - 4) + 1
        q = ((w5 >> (4 * p)) & 0xF).to(tl.float32) - zero[:, :, :, None, None]
        xs = tl.sum(tl.where((eight == v)[None, None, None, None, :], xf, 0.0), axis=4)
        prod = q[:, :, :, None, :, :] * xs[:, None, None, :, :, :]  # R, g, hi, token, c, jj
        d += tl.sum(tl.sum(prod, axis=5), axis=4)
    d = d * scale[:, :, :, None]
    # D's layout: lane (g, c), element (hi, e) holds token 2c + e
    d = tl.permute(tl.reshape(d, [R, 8, 2, 4, 2]), (0, 1, 3, 2, 4))  # R, g, c, hi, e
    return acc + tl.reshape(d, [R, TILE_WORDS])


@triton.jit
def _frag_kernel(
    x_ptr,  # [M, K], M <= 8
    q_ptr,  # [N / 16, K / 64, 32, 4] int32
    s_ptr,  # [N / 16, G, 8, 2]
    z_ptr,  # [N / 16, G, 8, 2] or dummy
    b_ptr,  # [N] or dummy
    out_ptr,  # [M, N]
    ws_ptr,  # SPLIT_K > 1: fp32 [SPLIT_K, M, N]
    count_ptr,  # SPLIT_K > 1: zeroed int32 counters, one per row block
    M,
    N,
    K,
    G,
    steps_per_split,
    stride_xm,
    stride_om,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    BF16: tl.constexpr,
    SPLIT_K: tl.constexpr,
    R: tl.constexpr,  # tile rows (steps) an iteration: num_warps x ROWS_PER_WARP
    GROUP_SHIFT: tl.constexpr,  # log2 of the steps a group; -1: one group (channel-wise)
    K_STAGES: tl.constexpr = 1,  # > 1: the words pipelined that many iterations (cp.async)
    ROTATE: tl.constexpr = True,  # each row block starts its K loop at its own iteration
):
    DTYPE: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    block = tl.program_id(0)
    steps_total = K // 64
    s_lo = tl.program_id(1) * steps_per_split
    s_hi = tl.minimum(steps_total, s_lo + steps_per_split)
    r = tl.arange(0, R)
    e = tl.arange(0, TILE_WORDS)
    g = e // 16
    # a lane's x: its token's (g) 16 k at 16c, as 64-bit words (4 k each); zero past the tokens
    x64 = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    x_lane = g.to(tl.int64) * (stride_xm // 4) + (e % 16)
    q_block = q_ptr + block.to(tl.int64) * steps_total * 128
    s32 = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # a lane's pair of rows: one int32
    z32 = z_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    pair_block = block.to(tl.int64) * G * 8
    acc = tl.zeros([R, TILE_WORDS], tl.float32)
    # Row blocks in flight at once would read the same offset of their 32-KB-apart rows (a
    # power-of-two stride through the DRAM channels) had they all walked K from its start:
    # ROTATE starts block b at iteration b mod the split's iterations and wraps around.
    iterations = tl.cdiv(s_hi - s_lo, R)
    rot = block % iterations if ROTATE else 0
    for j in tl.range(0, iterations, num_stages=K_STAGES):
        it = j + rot
        it = tl.where(it >= iterations, it - iterations, it)
        s0 = s_lo + it * R
        steps = s0 + r
        live = steps < s_hi
        steps = tl.minimum(steps, steps_total - 1)  # in bounds; its x reads as zeros
        words = tl.load(q_block + steps[:, None] * 128 + e[None, :])
        if GROUP_SHIFT >= 0:
            pairs = pair_block + (steps >> GROUP_SHIFT) * 8  # [R]: the group's 8 pairs
        else:
            pairs = pair_block + steps * 0
        x_mask = live[:, None] & (g < M)[None, :]
        s = tl.load(s32 + pairs[:, None] + g[None, :])
        z = tl.load(z32 + pairs[:, None] + g[None, :]) if HAS_ZEROS else s
        x = tl.load(x64 + (steps * 16)[:, None] + x_lane[None, :], mask=x_mask, other=0)
        if not ASM:
            acc = _frag_plain(words, acc, x, s, z, HAS_ZEROS, DTYPE, R)
        elif HAS_ZEROS:
            acc = tl.inline_asm_elementwise(
                _ASM_BF16_ZEROS if BF16 else _ASM_FP16_ZEROS, _CONSTRAINTS_ZEROS,
                args=[words, acc, x, s, z], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
        else:
            acc = tl.inline_asm_elementwise(
                _ASM_BF16 if BF16 else _ASM_FP16, _CONSTRAINTS,
                args=[words, acc, x, s], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
    # element e of D's layout (g, c, hi, e2) is token 2c + e2 of row 8 hi + g: a flat [128]
    # with its own offsets (no reshape, no permute)
    out = tl.sum(acc, axis=0)
    token = (e // 4) % 4 * 2 + e % 2
    n = block * BLOCK_ROWS + (e // 2) % 2 * 8 + e // 16
    out_mask = token < M
    if SPLIT_K > 1:
        out, out_mask = _split_k_sum_flat(out, ws_ptr, count_ptr, token * N + n, out_mask,
                                          M * N, SPLIT_K)  # fmt: skip
    if HAS_BIAS:
        out += tl.load(b_ptr + n).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + n, out.to(out_ptr.dtype.element_ty),
             mask=out_mask)  # fmt: skip


def _launch_override(spec: str) -> dict | None:
    """ATOM_WNA16_FRAG_LAUNCH's ``num_warps,rows_per_warp,per_sm[,maxnreg[,k_stages]]`` as a
    config (maxnreg 0: ptxas's)."""
    if not spec:
        return None
    parts = [int(p) for p in spec.split(",")]
    if not 3 <= len(parts) <= 5:
        raise ValueError("ATOM_WNA16_FRAG_LAUNCH: num_warps,rows_per_warp,per_sm[,maxnreg"
                         f"[,k_stages]], got {spec!r}")  # fmt: skip
    cfg = dict(num_warps=parts[0], ROWS_PER_WARP=parts[1], per_sm=parts[2])
    cfg.update(zip(("maxnreg", "k_stages"), parts[3:], strict=False))
    return cfg


LAUNCH_OVERRIDE = _launch_override(envs.ATOM_WNA16_FRAG_LAUNCH)


def frag_config(num_rows: int, n: int, k: int, sms: int, interpreted: bool = False) -> dict:
    """The launch of ``_frag_kernel``: 4 warps of 2 steps, K split to about 8 programs an SM,
    56 registers (ATOM_WNA16_FRAG_LAUNCH overrides it).
    NOTE (one H200, 2026-12-04, benchmarks/results/int-quant/s36/, cold L2, us for qkv / o /
    gate_up / down at one row): this launch 12.1 / 10.3 / 31.8 / 21.9 against ROW_MMA's
    (``int_quant_row_mma``, the rows layout's default) 9.4 / 7.0 / 29.2 / 17.3. Tying an
    iteration's loads before its math (an OR with a run-time zero; removed) was slower at every
    shape, register cap and tile (ncu at gate_up: with x tied too 84 registers, 31% occupancy,
    30% of DRAM; untied 64 registers, 42%, 45%; ROW_MMA 60, 45%, 48%): the one-row GEMMs are
    bound by the bytes in flight the occupancy allows, not by x's traffic or the instruction
    count (here ~22 a word with x's loads one line a warp, against ROW_MMA's 24 with 16). The
    engine's Llama-3-8B W4A16 decode (call 6): 2.88 against 2.57 ms at batch 1, **3.46 against
    4.08 ms at batch 8** (bf16 4.40 / 4.95), where the rows layout takes the packed dots.
    The words by the tensor memory accelerator into shared memory, ``k_stages`` iterations in
    flight (so the bytes in flight cost no registers; x and the scales by PTX), measured slower
    (s37/call1: the best TMA launch 12.7 / 10.3 / 30.1 / 20.9 us) and removed, as ROW_MMA's own
    TMA form (``int_quant_row_tma``, per-program and then persistent: slower at every shape)."""
    if interpreted:
        return dict(num_warps=1, ROWS_PER_WARP=2, per_sm=2)
    return dict(LAUNCH_OVERRIDE or dict(num_warps=4, ROWS_PER_WARP=2, per_sm=8, maxnreg=56))


def frag_usable(x: torch.Tensor) -> bool:
    """Whether the fragment kernel runs ``x`` here: 1-8 tokens of bf16 / fp16 on an NVIDIA GPU
    (its PTX) or under Triton's interpreter (its plain ops)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not 1 <= rows <= FRAG_MAX_TOKENS or x.dtype not in FRAG_DTYPES:
        return False
    return is_interpreted(x.device) or (x.device.type == "cuda" and not torch.version.hip)


def wna16_frag_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    config: dict | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b), W in the fragment layout, x of 1-8 rows (``frag_usable``); ``config``
    (``frag_config``'s keys, SPLIT_K: splits) overrides the launch."""
    blocks, steps_total = qweight.shape[:2]
    n, k = blocks * FRAG_ROWS, steps_total * FRAG_STEP
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    x2 = as_rows(x)  # 16-byte aligned rows: the PTX's x loads
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or (x2.shape[0] > 1 and x2.stride(0) % 8):
        x2 = x2.contiguous()
        if x2.data_ptr() % 16:
            x2 = x2.clone()
    num_rows = x2.shape[0]
    group_steps = steps_total // scales.shape[1]
    shift = -1 if scales.shape[1] == 1 else group_steps.bit_length() - 1
    if shift >= 0 and group_steps != 1 << shift:
        raise ValueError(f"wna16_frag_linear: groups of a power of two times {FRAG_STEP} k or "
                         f"one group (got {group_steps * FRAG_STEP})")  # fmt: skip
    sms = num_sms(x.device)
    cfg = frag_config(num_rows, n, k, sms, is_interpreted(x.device))
    cfg.update(config or {})
    tile_rows = cfg["num_warps"] * cfg["ROWS_PER_WARP"]
    splits = cfg.get("SPLIT_K")
    if splits is None:
        splits = max(1, min(triton.cdiv(sms * cfg["per_sm"], blocks),
                            triton.cdiv(steps_total, tile_rows)))  # fmt: skip
    per_split = triton.cdiv(triton.cdiv(steps_total, splits), tile_rows) * tile_rows
    splits = triton.cdiv(steps_total, per_split)
    counters = zeroed_counters(x.device, blocks) if splits > 1 else None
    if splits > 1 and counters is None:  # inside a capture that would grow them: no split
        splits, per_split = 1, triton.cdiv(steps_total, tile_rows) * tile_rows
    out2 = out.view(-1, n)
    ws = x2.new_empty((splits, num_rows, n), dtype=torch.float32) if splits > 1 else out2
    _frag_kernel[(blocks, splits)](
        x2, qweight, scales, zeros if zeros is not None else scales,
        bias if bias is not None else out2, out2, ws,
        counters if counters is not None else qweight, num_rows, n, k, scales.shape[1], per_split,
        x2.stride(0), out2.stride(0),
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        ASM=x.device.type == "cuda", BF16=x.dtype == torch.bfloat16, SPLIT_K=splits,
        R=tile_rows, GROUP_SHIFT=shift,
        K_STAGES=cfg.get("k_stages", 1), ROTATE=cfg.get("ROTATE", True),
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
        num_warps=cfg["num_warps"], num_stages=1,
    )  # fmt: skip
    return out
