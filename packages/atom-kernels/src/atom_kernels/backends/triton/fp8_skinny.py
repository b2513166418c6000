"""Block-FP8 GEMM for a few rows (batch 1-8 decode) in one kernel, weight-only: y = x W^T with W
dequantized tile by tile (fp8 x its [group_n, group_k] block scale) and x kept in its dtype, as
the torch reference (`dequantize_fp8_block`, then the GEMM) and the fused MoE compute it.

The w8a8 path (`quant.fp8_block_linear`) quantizes x per 1 x group_k group in a kernel of its
own, then runs the GEMM: two launches a projection, and a decode step of DeepSeek-V3 has about
six block-FP8 projections a layer. At a few rows the GEMM is a stream over W, so it needs no fp8
tensor cores: each program takes BLOCK_N output features and walks K, GROUPS scale groups a tile
([BLOCK_N, GROUPS * group_k] fp8, its [BLOCK_N, GROUPS] scales broadcast over each group), into
an fp32 multiply-add at one row or, at 2-8 rows, a dot of x with the tile dequantized to x's
dtype (the reference's rounding). With PDL (`pdl.py`) the first weight lines are asked for
before the wait on the previous kernel, as the bf16 skinny GEMM does.

`ATOM_FP8_SKINNY`: `auto` (the default) takes it at one row for weights of at most
AUTO_MAX_WEIGHTS elements, `1` at 1-8 rows of any weight, `0` never.
NOTE (one H200, 2026-12-01, benchmarks/results/int-quant/s25/gemm-skinny.json,
`quant_kernels.py --only gemm`, cold-L2 graphs, each checked against the reference; us, this
kernel against the w8a8 path `fp8_block_linear`): one row, DeepSeek-V3's q_a 11.7 / 14.3,
kv_a 12.4 / 12.8, shared gate_up 18.6 / 20.3, shared down 13.6 / 14.8 (weights of 4-29 M
elements), but q_b 34.5 / 22.0 and o_proj 57.3 / 44.6 (38 and 117 M); four rows slower at every
shape (17-96 against 10-45 us).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.common import as_rows, is_interpreted

MODE = envs.ATOM_FP8_SKINNY  # read at import (tests and benchmarks set it)
MAX_ROWS = 8
AUTO_MAX_ROWS = 1
AUTO_MAX_WEIGHTS = 1 << 25


@dataclass(frozen=True)
class Fp8SkinnyConfig:
    block_n: int
    groups: int  # scale groups (of group_k columns) a K tile
    num_warps: int


@triton.jit
def _fp8_skinny_kernel(
    x_ptr,
    w_ptr,  # [N, K] fp8
    ws_ptr,  # [ceil(N / group_n), ceil(K / GROUP_K)] fp32
    b_ptr,
    out_ptr,
    num_rows,
    N,
    K,
    group_n,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_om,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    GROUP_K: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # GROUPS * GROUP_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
    LINE: tl.constexpr,
    LINES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_rows
    n_mask = offs_n < N
    # Rows past N read row N - 1 (in bounds, discarded at the store): no mask on the W stream.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if USE_PDL:  # the weights' first lines into L2 while the previous kernel ends (pdl.py)
        pdl.prefetch_rows_then_wait(w_ptr, w_rows, stride_wn, 0, K, LINE, LINES)
    s_rows = ws_ptr + (w_rows // group_n) * stride_wsn  # [BLOCK_N]
    offs_g = tl.arange(0, GROUPS)
    offs_k = tl.arange(0, BLOCK_K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # one row: elementwise products, summed over K once at the end
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + offs_k
        k_mask = cols < K
        w = tl.load(w_ptr + w_rows[:, None] * stride_wn + cols[None, :], mask=k_mask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        groups = k // GROUP_K + offs_g
        scale = tl.load(s_rows[:, None] + groups[None, :] * stride_wsk,
                        mask=(groups * GROUP_K < K)[None, :], other=0.0)  # fmt: skip
        scale = tl.reshape(
            tl.broadcast_to(scale[:, :, None], [BLOCK_N, GROUPS, GROUP_K]), [BLOCK_N, BLOCK_K]
        )
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        if USE_DOT:  # the tile dequantized to x's dtype, as the reference rounds it
            acc = tl.dot(x, tl.trans((w * scale).to(x.dtype)), acc)
        else:
            acc2 += w * scale * x.to(tl.float32)  # x is [1, BLOCK_K]
    if not USE_DOT:
        acc = tl.reshape(tl.sum(acc2, axis=1), [BLOCK_M, BLOCK_N])
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=out_mask)


def default_config(num_rows: int, interpreted: bool) -> Fp8SkinnyConfig:
    """Narrow tiles over long K at one row (as the bf16 skinny GEMM's measured best, 4 x 1024
    bf16: 8 x 1024 fp8 is the same bytes in flight a program); 16 x 128 dots at 2-8 rows. Not
    tuned on a GPU yet."""
    if interpreted:
        return Fp8SkinnyConfig(16, 1, 4)
    if num_rows == 1:
        return Fp8SkinnyConfig(8, 8, 4)
    return Fp8SkinnyConfig(16, 1, 4)


def takes(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether this kernel runs the block-FP8 GEMM: 16-bit x on a GPU, a power-of-two scale group
    of at least 16 columns, and the rows MODE takes (`auto`: one row of a weight of at most
    AUTO_MAX_WEIGHTS elements; `1`: 1-8 rows; `0`: none)."""
    group_k = block[1]
    rows = math.prod(x.shape[:-1])
    if MODE == "1":
        fits = 0 < rows <= MAX_ROWS
    elif MODE == "auto":
        fits = 0 < rows <= AUTO_MAX_ROWS and weight.numel() <= AUTO_MAX_WEIGHTS
    else:
        fits = False
    return (
        fits
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and group_k >= 16
        and group_k & (group_k - 1) == 0
    )


def fp8_block_skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    config: Fp8SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [..., K] x (fp8 weight [N, K], scale [ceil(N / block[0]), ceil(K / block[1])])^T
    (+ bias) -> [..., N] in x's dtype (tests and benchmarks call it directly)."""
    n, k = weight.shape
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = as_rows(x)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    num_rows = x2.shape[0]
    config = config or default_config(num_rows, is_interpreted(x.device))
    use_dot = num_rows > 1
    block_m = 16 if use_dot else 1
    out2 = out.view(-1, n)
    use_pdl = pdl.enabled(x.device)
    group_k = block[1]
    _fp8_skinny_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(num_rows, block_m))](
        x2, weight, scale, bias if bias is not None else out2, out2, num_rows, n, k, block[0],
        x2.stride(0), weight.stride(0), scale.stride(0), scale.stride(1), out2.stride(0),
        HAS_BIAS=bias is not None, USE_DOT=use_dot, GROUP_K=group_k, GROUPS=config.groups,
        BLOCK_K=config.groups * group_k, BLOCK_M=block_m, BLOCK_N=config.block_n,
        USE_PDL=use_pdl, LINE=pdl.line_elements(weight), LINES=pdl.PREFETCH_LINES,
        num_warps=config.num_warps, **({"launch_pdl": True} if use_pdl else {}),
    )  # fmt: skip
    return out
