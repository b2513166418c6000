"""The one-row W4A16 GEMM of ``int_quant_row_mma`` (a warp on each of its rows' 512 contiguous
bytes a K tile, the same PTX) as a persistent kernel whose words and scales the tensor memory
accelerator brings into shared memory ``k_stages`` K tiles ahead (``ROW_TMA``).

ROW_MMA's programs each run their rows' few K tiles (4 at K = 4096) with each tile's load in
registers until its math: the bytes in flight an SM holds are what its resident warps' registers
hold (ncu, sessions 34-36: 45-50% occupancy, 47% of DRAM at gate_up). Session 37 measured the
same loop with its words by TMA, each program still a few tiles long, slower (each program
filled its pipeline anew, and the scales' loads, PTX outside it, waited on DRAM every tile).
Here a program is resident for the whole GEMM: it takes row blocks pid, pid + P, pid + 2P, ...
(P programs, as many row blocks each), and one flat loop walks (row block, K tile) pairs, so
Triton's pipeliner keeps ``k_stages - 1`` bulk copies in flight across row blocks; the scales
come by TMA too (their [BLOCK_N, 128 / GROUP_WORDS] box a K tile), x (an L1 hit) by ROW_MMA's
PTX, and the zeros (asymmetric) by TMA as the scales. A row block's sum is stored
at its last K tile; K is not split.

The tiles are read from shared memory in ROW_LAYOUT (a masked-off pointer load of the words
anchors that layout). Interpreter: the same loop on plain ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from atom_kernels.backends.triton.common import as_rows, num_sms
from atom_kernels.backends.triton.int_quant_packed_dot import magic_of
from atom_kernels.backends.triton.int_quant_row_mma import ROW_WORDS, _row_tile_math, _row_x_pairs

ROW_TMA_BLOCK_K = 1024  # k of a K tile (128 words)


@triton.jit
def _row_tma_kernel(
    x_ptr,  # [1, K]
    q_desc,  # descriptor of qweight [N, K / 8] int32, boxes [BLOCK_N, 128]
    q_ptr,  # qweight (a masked-off load of it anchors the words' layout)
    s_desc,  # descriptor of scales [N, G], boxes [BLOCK_N, 128 / GROUP_WORDS]
    z_desc,  # descriptor of zeros [N, G] as scales' (or scales')
    b_ptr,  # [N] or dummy
    out_ptr,  # [1, N]
    N,
    K,
    tiles,  # row blocks of BLOCK_N
    programs,  # P: program p takes row blocks p, p + P, ...
    stride_qn,
    all_ones,  # -1 at run time: the anchor's mask is false, which the compiler cannot see
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_WORDS: tl.constexpr,
    K_STAGES: tl.constexpr,
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    GROUPS: tl.constexpr = ROW_WORDS // GROUP_WORDS  # groups a K tile
    pid = tl.program_id(0)
    k_tiles = K // 1024
    items = tl.cdiv(tiles - pid, programs) * k_tiles  # (row block, K tile) pairs of this program
    offs_w = tl.arange(0, ROW_WORDS)
    offs_b = tl.arange(0, BLOCK_N)
    x_ptrs = x_ptr.to(tl.pointer_type(tl.int64)) + offs_w * 2  # each word's x_0 .. x_3
    # zero, loaded (masked off) outside the loop, where Triton's pipeliner leaves it
    never = tl.full([BLOCK_N, ROW_WORDS], 0, tl.int32) + all_ones == 0
    anchor = tl.load(q_ptr + offs_b[:, None] * stride_qn + offs_w[None, :], mask=never, other=0)
    acc = tl.zeros([BLOCK_N, ROW_WORDS], dtype=tl.float32)
    for it in tl.range(0, items, num_stages=K_STAGES):
        row0 = (pid + (it // k_tiles) * programs) * BLOCK_N
        kt = it % k_tiles
        words = q_desc.load([row0, kt * ROW_WORDS]) | anchor
        s = s_desc.load([row0, kt * GROUPS])  # [BLOCK_N, GROUPS]
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, GROUPS, GROUP_WORDS]),
                       [BLOCK_N, ROW_WORDS]).to(DTYPE)  # fmt: skip
        if HAS_ZEROS:  # -(magic + zero): exact in DTYPE (integer zeros < 16)
            z = z_desc.load([row0, kt * GROUPS])
            z = tl.reshape(tl.broadcast_to(z[:, :, None], [BLOCK_N, GROUPS, GROUP_WORDS]),
                           [BLOCK_N, ROW_WORDS])  # fmt: skip
            nz = (-(z.to(tl.float32) + magic_of(DTYPE))).to(DTYPE)
        else:
            nz = tl.full([BLOCK_N, ROW_WORDS], -(magic_of(DTYPE) + 8), DTYPE)
        xa, xb, xc, xd = _row_x_pairs(x_ptrs + kt * (ROW_WORDS * 2), words.shape, ASM)
        acc = _row_tile_math(words, xa, xb, xc, xd, s, acc, nz, HAS_ZEROS, ASM, DTYPE)
        if kt == k_tiles - 1:  # the row block's last K tile: its sums out
            offs_n = row0 + offs_b
            out = tl.sum(acc, axis=1)  # [BLOCK_N]
            if HAS_BIAS:
                out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)
            acc = tl.zeros([BLOCK_N, ROW_WORDS], dtype=tl.float32)


def row_tma_fits(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, bits: int, group_size: int, k: int,
                 has_g_idx: bool) -> list[str]:  # fmt: skip
    """What keeps a launch out of ``_row_tma_kernel`` (empty: it runs)."""
    why = []
    if x2.shape[0] != 1 or bits != 4 or x2.dtype not in (torch.bfloat16, torch.float16):
        why.append(f"one row of bf16 / fp16 x and 4-bit weights (got {x2.shape[0]} rows, "
                   f"{x2.dtype}, {bits}-bit)")  # fmt: skip
    if (scales.dtype != x2.dtype or has_g_idx or group_size not in (32, 64, 128)
            or k % ROW_TMA_BLOCK_K):  # fmt: skip
        why.append(f"scales of x's dtype, no g_idx, groups of 32, 64 or 128 and K of "
                   f"{ROW_TMA_BLOCK_K} (got {scales.dtype}, group {group_size}, "
                   f"K {k})")  # fmt: skip
    if qweight.stride(1) != 1 or qweight.data_ptr() % 16 or qweight.stride(0) % 4:
        why.append("contiguous words in 16-byte aligned rows (a TMA descriptor's)")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and (t.stride(1) != 1 or t.data_ptr() % 16 or t.stride(0) % 8
                              or t.element_size() != 2):  # fmt: skip
            why.append(f"16-bit contiguous {name} in 16-byte aligned rows (a TMA descriptor's)")
    return why


def row_tma_programs(tiles: int, sms: int, per_sm: int) -> int:
    """P, the persistent programs of ``tiles`` row blocks: about ``per_sm`` an SM, as many row
    blocks each (the fewest programs at the fewest row blocks a program)."""
    per_program = triton.cdiv(tiles, sms * per_sm)
    return triton.cdiv(tiles, per_program)


def wna16_row_tma_linear(x, qweight, scales, zeros, bias, cfg: dict) -> torch.Tensor:
    """y = x W^T (+ b) at one row with ``_row_tma_kernel`` (``cfg``: BLOCK_N, num_warps,
    k_stages, per_sm, maxnreg)."""
    n, kw = qweight.shape
    k = kw * 8
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    x2 = as_rows(x)
    if x2.stride(-1) != 1 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
        if x2.data_ptr() % 16:
            x2 = x2.clone()
    block_n = cfg["BLOCK_N"]
    tiles = triton.cdiv(n, block_n)
    programs = row_tma_programs(tiles, num_sms(x.device), cfg.get("per_sm", 1))
    group_words = k // scales.shape[1] // 8
    q_desc = TensorDescriptor(qweight, [n, kw], [qweight.stride(0), 1],
                              [block_n, ROW_TMA_BLOCK_K // 8])  # fmt: skip
    box = [block_n, ROW_TMA_BLOCK_K // 8 // group_words]  # a K tile's groups
    s_desc = TensorDescriptor(scales, list(scales.shape), [scales.stride(0), 1], box)
    z_desc = s_desc if zeros is None else TensorDescriptor(zeros, list(zeros.shape),
                                                           [zeros.stride(0), 1], box)  # fmt: skip
    _row_tma_kernel[(programs,)](
        x2, q_desc, qweight, s_desc, z_desc, bias if bias is not None else out, out, n, k,
        tiles, programs, qweight.stride(0), -1,
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        ASM=x.device.type == "cuda", BLOCK_N=block_n, GROUP_WORDS=group_words,
        K_STAGES=cfg.get("k_stages", 4), num_warps=cfg["num_warps"], num_stages=1,
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )  # fmt: skip
    return out
