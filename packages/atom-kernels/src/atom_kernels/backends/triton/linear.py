"""Triton skinny GEMM: ``y = x W^T (+ b)`` for a few rows of x (batch-1..8 decode), else cuBLAS.

A decode step at a small batch reads every weight once and multiplies it by a handful of rows:
the GEMM is a stream over W. ``_skinny_kernel`` gives each program BLOCK_N output features and
walks all of K: W tiles [BLOCK_N, BLOCK_K] flow through the software pipeline (num_stages deep)
into a dot with the x rows (padded to BLOCK_M >= 16) or, at one row, into an fp32 multiply-add.
The grid (N / BLOCK_N programs, times the K splits) is a shape-only function (CUDA-graph safe).

Split-K (a config's ``split_k`` > 1: weights with few output features, e.g. a small model's
o / down projections, whose N / BLOCK_N programs leave SMs idle): program (n, s) walks the s-th
slice of K and writes its fp32 partial [rows, BLOCK_N] to a workspace, then counts itself in on
its N tile's counter (an atomic with release/acquire semantics). The program that arrives last
sums the SPLIT_K partials in split order (deterministic), adds the bias, writes the output and
sets the counter back to zero, so no separate reduce kernel runs and the counters need no
zeroing between calls or graph replays.

Where cuBLAS stays: more rows than SKINNY_MAX_ROWS (the GEMM stops being a pure weight stream),
fp32 (tests' precision, not speed), and weights whose feature count gives fewer programs than
SMs at the smallest tile (small models: cuBLAS's split-K keeps the SMs busy there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.common import as_rows, is_interpreted, num_sms, zeroed_counters

SKINNY_MAX_ROWS = 8
MIN_WEIGHT_BYTES = 16 << 20
# Split-K on: weights with fewer output features than 16 per SM (too few programs without a
# split) and at least this many bytes take the split-K kernel instead of cuBLAS.
# NOTE (one H100, triton 3.6, torch 2.11, 2026-11-24): without programmatic dependent launch it
# measured no faster (benchmarks/results/splitk-h100: Qwen3-0.6B's o (1024 x 2048) and down
# (1024 x 3072) at one row, best split-K tile 6.3 / 7.5 us against cuBLAS's 5.9 / 8.0; decode at
# batch 1 / 8 1.49 / 1.79 ms with it, 1.47 / 1.74 without). With PDL (pdl.py) the whole layer's
# chain of kernels overlaps, cuBLAS breaking it no more: Qwen3-0.6B decode at batch 1 / 8
# 1.318, 1.319 / 1.602, 1.602 ms without split-K, 1.238, 1.235 / 1.552, 1.550 with it
# (results/s11-h100/pdl-call3, two rounds alternating). So it follows PDL by default;
# ATOM_SKINNY_SPLIT_K=1 / 0 forces it on / off.
SPLIT_K_MIN_WEIGHT_BYTES = 2 << 20
SPLIT_K_SETTING = envs.ATOM_SKINNY_SPLIT_K


def split_k_enabled(device: torch.device) -> bool:
    """Whether the split-K kernel takes the small weights on ``device`` (see the NOTE above)."""
    if SPLIT_K_SETTING != "auto":
        return SPLIT_K_SETTING == "1"
    return pdl.enabled(device)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = True
    split_k: int = 1
    # One row, K a multiple of block_k: load the next W tile before this one's multiply-adds.
    prefetch: bool = False
    # Rows of x a program takes (dots only): more rows than this tile the grid's third axis.
    block_m: int = 16


@triton.jit(do_not_specialize=["k_tiles_per_split"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    num_rows,
    N,
    K,
    k_tiles_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    LINE: tl.constexpr = 64,
    LINES: tl.constexpr = 8,
    PREFETCH: tl.constexpr = False,
):
    # M = rows of x (BLOCK_M a program), N = output features, K = input features; split s of SPLIT_K
    # walks K in [s, s + 1) * k_tiles_per_split * BLOCK_K (a multiple of BLOCK_K: the compiler
    # keeps its alignment, so the W loads stay vectorized); program (n, s, m) takes rows
    # [m, m + 1) * BLOCK_M of x
    pid = tl.program_id(0)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(1) * k_tiles_per_split * BLOCK_K
        k_hi = tl.minimum(K, k_lo + k_tiles_per_split * BLOCK_K)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    n_mask = offs_n < N
    # Rows past N read row N - 1 (in bounds, discarded at the store): no mask on the W stream.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if USE_PDL:  # the weights' first lines into L2 while the previous kernel ends (pdl.py)
        pdl.prefetch_rows_then_wait(w_ptr, w_rows, stride_wn, k_lo, K, LINE, LINES)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # one row: elementwise products, summed over K once at the end
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PREFETCH:
        # One row, EVEN_K: the next W tile's loads go out before this tile's multiply-adds, two
        # tiles in flight a program (W goes to registers at one row: no pipeline does it).
        w = tl.load(w_ptrs)
        for k in range(k_lo, k_hi, BLOCK_K):
            x = tl.load(x_ptrs)
            ahead = (offs_k + (k + BLOCK_K - k_lo)) < k_hi  # all false on the last tile
            w_next = tl.load(w_ptrs + BLOCK_K, mask=ahead[None, :], other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)
            w = w_next
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            else:
                k_mask = (k - k_lo + offs_k) < k_hi
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if USE_DOT:
                acc = tl.dot(x, tl.trans(w), acc)
            else:
                acc2 += w.to(tl.float32) * x.to(tl.float32)  # x is [1, BLOCK_K]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.reshape(tl.sum(acc2, axis=1), [BLOCK_M, BLOCK_N])
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        # [SPLIT_K, num_rows, N] fp32 partials; the last program of this N tile sums them.
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + tl.program_id(1) * num_rows * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the release below
        counter = count_ptr + tl.program_id(2) * tl.num_programs(0) + pid  # one per (m, n) tile
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived != SPLIT_K - 1:
            return
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(SPLIT_K):  # split order: the same sum on every run
            acc += tl.load(
                part_ptr + s * num_rows * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg"
            )
        tl.atomic_xchg(counter, 0)  # ready for the next call (and graph replay)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=out_mask)


# One-row tiles of the layers' projections (N <= ONE_ROW_MAX_N: not LM heads) with K >= 4096. At
# one row the W tile goes straight to registers (no shared-memory pipeline: num_stages does
# nothing), so the bytes in flight are the resident programs times their tile: narrow tiles
# (4-8 output features) over long K blocks keep more of them in flight than 16 x 512.
# NOTE (tune_linear.py --wide-one-row, one H100, triton 3.6, torch 2.11, PDL on, 2026-11-24,
# results/s12-h100/h17a-call1/tune-one-row.json; us a GEMM at one row, CUDA graphs over 1.5 GB of
# weight copies): Llama-3-8B qkv (6144 x 4096) 4 x 1024 / 4 warps 17.6 against 16 x 512's 19.2
# (cuBLAS 20.8); o (4096 x 4096) 4 x 1024 13.5 (8 x 2048 / 8 warps 13.5) against 15.2; down
# (4096 x 14336) 8 x 2048 / 8 warps 40.3 (4 x 1024: 43.6) against 46.1 (cuBLAS 44.8). Split-K
# (2, 4) was never the best; 16 x 1024 / 8 warps was slower than 16 x 512 on all three.
# In the engine (decode_ab.sh, results/s12-h100/h17a-call2, Llama-3-8B batch 1, ms a step):
# 5.605 with these tiles against 5.880 with 16 x 512 (and main's other defaults); loading ahead
# (prefetch, then ATOM_SKINNY_PREFETCH=1) 5.716 / 5.714, 8 x 2048 / 8 warps everywhere 5.734 /
# 5.732. So the narrow tiles are the only ones, without prefetch (the switches that turned them
# off, ATOM_SKINNY_NARROW=0, and prefetch on, ATOM_SKINNY_PREFETCH=1, are gone; the kernel's
# PREFETCH stays for tune_linear.py --wide-one-row and ATOM_SKINNY_ONE_ROW's fifth field).
ONE_ROW_MAX_N = 16384
ONE_ROW_MIN_K = 4096
# A/B knob that replaces them (and applies at any K):
# ATOM_SKINNY_ONE_ROW="block_n,block_k,num_warps[,split_k[,prefetch]]" (multiply-adds).


def _one_row_override(spec: str) -> SkinnyConfig | None:
    if not spec:
        return None
    try:
        fields = [int(f) for f in spec.split(",")]
        block_n, block_k, num_warps, *rest = fields
        split = rest[0] if rest else 1
        prefetch = len(rest) > 1 and rest[1] == 1
        if len(rest) > 2 or min(fields[:4]) < 1 or (len(rest) > 1 and rest[1] not in (0, 1)):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"ATOM_SKINNY_ONE_ROW={spec!r}: expected 'block_n,block_k,num_warps[,split_k"
            "[,prefetch]]' (positive integers, powers of two for the blocks; prefetch 0 or 1)"
        ) from None
    return SkinnyConfig(
        block_n, block_k, num_warps, 1, use_dot=False, split_k=split, prefetch=prefetch
    )


ONE_ROW_OVERRIDE = _one_row_override(envs.ATOM_SKINNY_ONE_ROW)


def one_row_config(n: int, k: int) -> SkinnyConfig | None:
    """The tile of a layer's one-row [1, k] x [n, k]^T GEMM (see ONE_ROW_MAX_N), or None for the
    16 x 512 default: ATOM_SKINNY_ONE_ROW's, else 8 x 2048 / 8 warps from K = 8192 and 4 x 1024
    / 4 warps from K = 4096."""
    if n > ONE_ROW_MAX_N:
        return None
    if ONE_ROW_OVERRIDE is not None:
        return ONE_ROW_OVERRIDE
    if k < ONE_ROW_MIN_K:
        return None
    if k >= 2 * ONE_ROW_MIN_K:
        return SkinnyConfig(8, 2048, 8, 1, use_dot=False)
    return SkinnyConfig(4, 1024, 4, 1, use_dot=False)


def default_config(
    num_rows: int, n: int, k: int, sms: int, interpreted: bool, split_k: bool = False
) -> SkinnyConfig:
    """Tiles for an [num_rows, k] x [n, k]^T GEMM.

    One row, a layer's projection with K >= 4096: ``one_row_config`` (narrow tiles, its NOTE).
    NOTE (benchmarks/tune_linear.py, one H100, triton 3.6, torch 2.11, CUDA graphs over 1.5 GB of
    weight copies, 2026-11-22, tune-linear-h100.json): at one row the fp32 multiply-add over
    16 x 512 tiles (4 warps, 5 stages) was within 1% of the best tile on every Llama-3-8B
    projection: qkv / o / gate_up / down / LM head 20.0 / 14.6 / 79.7 / 44.5 / 338.8 us against
    cuBLAS's 20.8 / 16.9 / 81.7 / 44.9 / 374.6 (o and down: cuBLAS split-K plus its reduce). At
    4-8 rows dots over 32 x 128 tiles (32 x 256 for K >= 8192): 20.1 / 14.4 / ~81 / 42.6 / ~345.
    """
    if interpreted:
        return SkinnyConfig(16, 32, 4, 1, use_dot=num_rows > 1)
    if num_rows == 1 and ONE_ROW_OVERRIDE is not None and n <= ONE_ROW_MAX_N:
        return ONE_ROW_OVERRIDE  # its own split count
    if num_rows == 1:
        config = one_row_config(n, k) or SkinnyConfig(16, 512, 4, 5, use_dot=False)
    else:
        config = SkinnyConfig(32, 256 if k >= 8192 else 128, 4, 5)
    if not split_k:  # split_k_enabled(device): with PDL only (see the NOTE above)
        return config
    return dataclasses.replace(config, split_k=split_k_for(n, k, config, sms))


def split_k_for(n: int, k: int, config: SkinnyConfig, sms: int) -> int:
    """K splits that bring the programs to about two per SM when the N tiles alone are fewer
    than the SMs (1 otherwise), each split at least one K tile."""
    tiles = triton.cdiv(n, config.block_n)
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(k, config.block_k), triton.cdiv(2 * sms, tiles)))


def use_skinny(
    num_rows: int, n: int, k: int, dtype: torch.dtype, sms: int, split_k: bool = False
) -> bool:
    """Whether the Triton kernel takes this GEMM (see the module docstring). Weights under
    MIN_WEIGHT_BYTES stay on cuBLAS: Qwen3-0.6B's 4-12 MB projections ran within +-10% of it
    either way (launch and tail bound), its 311 MB LM head 8% faster in Triton."""
    weight_bytes = n * k * dtype.itemsize
    if not 0 < num_rows <= SKINNY_MAX_ROWS or dtype == torch.float32:
        return False
    if n >= 16 * sms:
        return weight_bytes >= MIN_WEIGHT_BYTES
    return split_k and weight_bytes >= SPLIT_K_MIN_WEIGHT_BYTES


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """The Triton kernel on [..., K] x [N, K]^T (tests call it directly): rows past the config's
    block_m (dots; 16 by default) tile the grid's third axis."""
    n, k = weight.shape
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    x2 = as_rows(x)
    num_rows = x2.shape[0]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    config = config or default_config(
        num_rows, n, k, num_sms(x.device), is_interpreted(x.device), split_k_enabled(x.device)
    )
    use_dot = config.use_dot or num_rows > 1
    block_m = max(16, config.block_m) if use_dot else 1
    m_tiles = triton.cdiv(num_rows, block_m)
    out2 = out.view(-1, n)
    tiles = triton.cdiv(n, config.block_n)
    # Each split a whole number of K tiles; the last may be short (or empty: it adds zeros).
    k_tiles = triton.cdiv(k, config.block_k)
    k_tiles_per_split = triton.cdiv(k_tiles, config.split_k)
    split_k = triton.cdiv(k_tiles, k_tiles_per_split)
    counters = zeroed_counters(x.device, tiles * m_tiles) if split_k > 1 else None
    if counters is None:  # no split (or no counters yet inside a graph capture)
        split_k, k_tiles_per_split, counters = 1, k_tiles, weight
    partials = x2.new_empty((split_k, num_rows, n), dtype=torch.float32) if split_k > 1 else out2
    use_pdl = pdl.enabled(x.device)
    _skinny_kernel[(tiles, split_k, m_tiles)](
        x2,
        weight,
        bias if bias is not None else weight,
        out2,
        partials,
        counters,
        num_rows,
        n,
        k,
        k_tiles_per_split,
        x2.stride(0),
        weight.stride(0),
        out2.stride(0),
        HAS_BIAS=bias is not None,
        USE_DOT=use_dot,
        EVEN_K=k % config.block_k == 0,
        SPLIT_K=split_k,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_PDL=use_pdl,
        LINE=pdl.line_elements(weight),
        LINES=pdl.PREFETCH_LINES,
        PREFETCH=config.prefetch and not use_dot and k % config.block_k == 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton kernel runs this GEMM (see the module docstring); cuBLAS otherwise.
    Interpreted (CPU) runs keep torch: the interpreter is for the kernel tests, not for models."""
    if is_interpreted(x.device):
        return False
    num_rows = math.prod(x.shape[:-1])
    sms = num_sms(x.device)
    return use_skinny(num_rows, *weight.shape, x.dtype, sms, split_k_enabled(x.device))
