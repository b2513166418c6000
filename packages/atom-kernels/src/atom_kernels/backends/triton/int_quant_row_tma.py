"""The one-row W4A16 GEMM of ``int_quant_row_mma`` (a warp on each of its rows' 512 contiguous
bytes a K tile, the same PTX) with the words brought by the tensor memory accelerator into
shared memory, ``k_stages`` K tiles ahead (``ROW_TMA``; prepared in session 36, not yet measured).

Session 36's ncu put the one-row GEMMs' limit at the bytes in flight their registers allow (a
load in flight holds its destination registers: 45% occupancy, 48% of DRAM at gate_up). A bulk
tensor copy holds none: a program's next tiles stream into shared memory while it computes
this one, and only x and the scales (PTX loads, out of Triton's pipeliner) use registers.

The tile is [BLOCK_N, 128] words of BLOCK_N consecutive rows at one K tile (a box of the
weight's [N, K / 8] descriptor; rows past N read as zeros), read from shared memory in
ROW_LAYOUT (a masked-off pointer load of the same words anchors that layout). Interpreter: the
same loop on plain ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from atom_kernels.backends.triton.common import as_rows, num_sms, zeroed_counters
from atom_kernels.backends.triton.int_quant_row_mma import (
    ROW_WORDS,
    _row_scales,
    _row_tile_math,
    _row_x_pairs,
)
from atom_kernels.backends.triton.split_k import _split_k_sum_flat

ROW_TMA_BLOCK_K = 1024  # k of a K tile (128 words)


@triton.jit
def _row_tma_kernel(
    x_ptr,  # [1, K]
    q_desc,  # descriptor of qweight [N, K / 8] int32, boxes [BLOCK_N, 128]
    q_ptr,  # qweight (a masked-off load of it anchors the words' layout)
    s_ptr,  # [N, G]
    z_ptr,  # [N, G] or dummy
    b_ptr,  # [N] or dummy
    out_ptr,  # [1, N]
    ws_ptr,  # SPLIT_K > 1: fp32 [SPLIT_K, N]
    count_ptr,  # SPLIT_K > 1: zeroed int32 counters, one per BLOCK_N rows
    N,
    K,
    k_tiles_per_split,
    stride_qn,
    stride_sn,
    stride_zn,
    all_ones,  # -1 at run time: the anchor's mask is false, which the compiler cannot see
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_WORDS: tl.constexpr,
    K_STAGES: tl.constexpr,
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_w = tl.arange(0, ROW_WORDS)
    k_lo = tl.program_id(1) * k_tiles_per_split * 1024
    k_hi = tl.minimum(K, k_lo + k_tiles_per_split * 1024)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_w[None, :]  # [BLOCK_N, 128]
    x_ptrs = x_ptr.to(tl.pointer_type(tl.int64)) + offs_w * 2  # each word's x_0 .. x_3
    # zero, loaded (masked off) outside the loop, where Triton's pipeliner leaves it
    never = tl.full([BLOCK_N, ROW_WORDS], 0, tl.int32) + all_ones == 0
    anchor = tl.load(q_ptrs, mask=never, other=0)
    acc = tl.zeros([BLOCK_N, ROW_WORDS], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, 1024, num_stages=K_STAGES):
        words = q_desc.load([pid_n * BLOCK_N, k0 // 8]) | anchor
        s, nz = _row_scales(s_ptr, z_ptr, rows, offs_w, k0, stride_sn, stride_zn, HAS_ZEROS,
                            ASM, GROUP_WORDS, DTYPE)  # fmt: skip
        xa, xb, xc, xd = _row_x_pairs(x_ptrs + (k0 // 8) * 2, words.shape, ASM)
        acc = _row_tile_math(words, xa, xb, xc, xd, s, acc, nz, HAS_ZEROS, ASM, DTYPE)
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    mask = offs_n < N
    if SPLIT_K > 1:
        out, mask = _split_k_sum_flat(out, ws_ptr, count_ptr, offs_n, mask, N, SPLIT_K)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask)


def row_tma_fits(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int,
                 group_size: int, k: int, has_g_idx: bool) -> list[str]:  # fmt: skip
    """What keeps a launch out of ``_row_tma_kernel`` (empty: it runs)."""
    why = []
    if x2.shape[0] != 1 or bits != 4 or x2.dtype not in (torch.bfloat16, torch.float16):
        why.append(f"one row of bf16 / fp16 x and 4-bit weights (got {x2.shape[0]} rows, "
                   f"{x2.dtype}, {bits}-bit)")  # fmt: skip
    if scales.dtype != x2.dtype or has_g_idx or group_size % 32 or k % ROW_TMA_BLOCK_K:
        why.append(f"scales of x's dtype, no g_idx, groups of 32 and K of {ROW_TMA_BLOCK_K} "
                   f"(got {scales.dtype}, group {group_size}, K {k})")  # fmt: skip
    if qweight.stride(1) != 1 or qweight.data_ptr() % 16 or qweight.stride(0) % 4:
        why.append("contiguous words in 16-byte aligned rows (a TMA descriptor's)")
    return why


def wna16_row_tma_linear(x, qweight, scales, zeros, bias, cfg: dict) -> torch.Tensor:
    """y = x W^T (+ b) at one row with ``_row_tma_kernel`` (``cfg``: BLOCK_N, num_warps,
    k_stages, per_sm, SPLIT_K (None: about per_sm programs an SM), maxnreg)."""
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
    k_tiles = k // ROW_TMA_BLOCK_K
    splits = cfg.get("SPLIT_K") or max(1, min(triton.cdiv(num_sms(x.device) * cfg["per_sm"],
                                                          tiles), k_tiles))  # fmt: skip
    per_split = triton.cdiv(k_tiles, splits)
    splits = triton.cdiv(k_tiles, per_split)
    counters = zeroed_counters(x.device, tiles) if splits > 1 else None
    if splits > 1 and counters is None:  # inside a capture that would grow them: no split
        splits, per_split = 1, k_tiles
    ws = x2.new_empty((splits, n), dtype=torch.float32) if splits > 1 else out
    box = [block_n, ROW_TMA_BLOCK_K // 8]  # a K tile of BLOCK_N rows
    desc = TensorDescriptor(qweight, [n, kw], [qweight.stride(0), 1], box)
    group_size = k // scales.shape[1]
    _row_tma_kernel[(tiles, splits)](
        x2, desc, qweight, scales, zeros if zeros is not None else scales,
        bias if bias is not None else out, out, ws,
        counters if counters is not None else qweight, n, k, per_split, qweight.stride(0),
        scales.stride(0), zeros.stride(0) if zeros is not None else 0, -1,
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        ASM=x.device.type == "cuda", SPLIT_K=splits, BLOCK_N=block_n,
        GROUP_WORDS=group_size // 8, K_STAGES=cfg.get("k_stages", 3),
        num_warps=cfg["num_warps"], num_stages=1,
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )  # fmt: skip
    return out
