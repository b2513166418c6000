"""Triton skinny GEMMs with their neighbours fused in, for a few rows of x (batch-1 decode): the
gate/up GEMM with SiLU-and-mul in its epilogue, an RMSNorm in front of it or of a plain GEMM.

``out = silu(x W_gate^T + b_gate) * (x W_up^T + b_up)`` with W = [W_gate; W_up] ([2N, K], the
packed gate_up weight of a gated MLP). Unfused, a decode step runs the gate_up GEMM, writes
[rows, 2N], and launches ``silu_and_mul`` to read it back: a second launch per layer, about 1.2 us
of GPU time plus its launch gap at batch 1 (Qwen3-0.6B on an H100, results/
profile-decode-qwen3-0.6b-bs1-h100.json: 28 ``_gated_kernel`` launches, 34 us of a 1.45 ms step).

``_gated_skinny_kernel`` is ``linear._skinny_kernel`` (no split-K) walking two W streams: program
n owns output features [n * BLOCK_N, (n + 1) * BLOCK_N) and reads those rows of W_gate and of
W_up over all of K, so both halves of each output meet in its registers. Each half is rounded to
x's dtype before the activation, so the result is what ``linear`` then ``silu_and_mul`` give.

With HAS_NORM the kernel also runs the decoder layer's post-attention ``fused_add_rms_norm`` in
front (``norm_gated_skinny_linear``, one row only: ``takes_norm``): every program first walks
x + residual for the row's statistics (a few KB, from L2), then normalizes each K tile as it
feeds the GEMM; program 0 writes x + residual. Another launch per layer fewer (the norm took
~1.75 us a launch in the same profile: 57 ``_rms_norm_kernel`` launches, 100 us).
ATOM_FUSED_NORM_GATE_UP=0 turns that part off (the norm's own kernel, then the fused GEMM).

GATED=False makes it a plain GEMM with the norm in front: ``norm_skinny_linear`` (the
``rms_norm_linear`` op), a decoder layer's input norm (with or without a residual) and QKV
projection in one launch at one row (``takes_norm_linear``; ATOM_FUSED_NORM_QKV=0 turns it off).
That moves Qwen3-0.6B's QKV GEMM (4096 x 1024) off cuBLAS at one row: the plain Triton kernel
took 5.5-5.7 us there against cuBLAS's 5.6 (results/tune-linear-h100.json).

Where it runs (``takes``): up to SKINNY_MAX_ROWS rows of x, 16-bit dtypes, not interpreted.
ATOM_FUSED_GATE_UP=0 turns it off (the GEMM and ``silu_and_mul``, for A/B measurements).
NOTE (results/tune-linear-h100.json, one H100, triton 3.6, 2026-11-22): on Qwen3-0.6B's gate_up
(6144 x 1024, a 12.6 MB weight: below the size where the plain GEMM leaves cuBLAS) the plain
Triton kernel took 6.8-7.3 us at 1 / 4 / 8 rows against cuBLAS's 7.1, so streaming both halves
in Triton should cost no more than cuBLAS and saves the activation's launch.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton import linear, pdl
from atom_kernels.backends.triton.common import as_rows, is_interpreted
from atom_kernels.backends.triton.linear import SKINNY_MAX_ROWS, SkinnyConfig

ENABLED = envs.ATOM_FUSED_GATE_UP
NORM_ENABLED = envs.ATOM_FUSED_NORM_GATE_UP
NORM_LINEAR_ENABLED = envs.ATOM_FUSED_NORM_QKV
# One row: the norm's statistics in the GEMM's loop, its scale after it (ONE_PASS in the kernel).
# ATOM_NORM_ONE_PASS: "linear" (default) for the norm + plain GEMM (QKV), "1" for the gated GEMM
# too, "0" for neither (see NORM_LINEAR_MAX_FEATURES's NOTE).
_ONE_PASS = envs.ATOM_NORM_ONE_PASS
NORM_ONE_PASS = _ONE_PASS == "1"  # the gated kernel (post-attention norm + gate/up)
NORM_ONE_PASS_LINEAR = _ONE_PASS in ("1", "linear")  # the plain one (input norm + QKV)


@triton.jit
def _gated_skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    eps,
    num_rows,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    stride_rom,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    LINE: tl.constexpr = 64,
    LINES: tl.constexpr = 8,
    ONE_PASS: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    # M = rows of x (<= BLOCK_M), N = output features (GATED: W has 2N rows, gate then up),
    # K = input features
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    n_mask = offs_n < N
    # Rows past N read row N - 1 (in bounds, discarded at the store): no mask on the W streams.
    gate_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if USE_PDL:  # the weights' first lines into L2 while the previous kernel ends (pdl.py)
        if GATED:
            pdl.prefetch_rows(w_ptr, gate_rows + N, stride_wn, 0, K, LINE, LINES)
        pdl.prefetch_rows_then_wait(w_ptr, gate_rows, stride_wn, 0, K, LINE, LINES)
    g_ptrs = w_ptr + gate_rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if GATED:
        u_ptrs = w_ptr + (gate_rows + N)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    if HAS_NORM:
        # (x + residual), RMS-normalized with rms_norm's roundings, is the GEMM's input. Every
        # program walks the rows once for their statistics; program 0 writes x + residual.
        # ONE_PASS (one row, no dot): the statistics accumulate in the GEMM's own loop and the
        # row's scale 1 / rms multiplies the sums at the end (W (g * x) / rms = W (g * x / rms)),
        # so the weight stream starts at once; the normed operand is not rounded to x's dtype.
        r_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :]
        ro_ptrs = res_out_ptr + offs_m[:, None] * stride_rom + offs_k[None, :]
        is_first = (offs_m[:, None] * 0 + pid) == 0
        if ONE_PASS:
            squares2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        else:
            squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                mask = m_mask[:, None] & ((k + offs_k) < K)[None, :]
                x = tl.load(x_ptrs + k, mask=mask, other=0.0)
                s = x.to(tl.float32)
                if HAS_RESIDUAL:
                    r = tl.load(r_ptrs + k, mask=mask, other=0.0)
                    s = (s + r.to(tl.float32)).to(x.dtype).to(tl.float32)
                squares += tl.sum(s * s, axis=1)
            inv = tl.rsqrt(squares / K + eps)[:, None]  # [BLOCK_M, 1]
    if USE_DOT:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATED:
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # one row: elementwise products, summed over K once at the end
        acc_g2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if GATED:
            acc_u2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PREFETCH:  # one row, EVEN_K: each W tile loaded one step ahead (linear.py's PREFETCH)
        g_next = tl.load(g_ptrs)
        if GATED:
            u_next = tl.load(u_ptrs)
    for k in range(0, K, BLOCK_K):
        if PREFETCH:
            ahead = ((k + BLOCK_K + offs_k) < K)[None, :]  # all false on the last tile
            g = g_next
            g_next = tl.load(g_ptrs + BLOCK_K, mask=ahead, other=0.0)
            if GATED:
                u = u_next
                u_next = tl.load(u_ptrs + BLOCK_K, mask=ahead, other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        elif EVEN_K:
            g = tl.load(g_ptrs)
            if GATED:
                u = tl.load(u_ptrs)
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            g = tl.load(g_ptrs, mask=k_mask[None, :], other=0.0)
            if GATED:
                u = tl.load(u_ptrs, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_NORM:
            mask = m_mask[:, None] & ((k + offs_k) < K)[None, :]
            if HAS_RESIDUAL:
                r = tl.load(r_ptrs, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
                tl.store(ro_ptrs, x, mask=mask & is_first)
                r_ptrs += BLOCK_K
                ro_ptrs += BLOCK_K
            nw = tl.load(norm_w_ptr + k + offs_k, mask=(k + offs_k) < K, other=0.0)
            if ONE_PASS:
                s = x.to(tl.float32)  # (x + residual) in x's dtype, as rms_norm squares it
                squares2 += s * s
                x = nw.to(tl.float32)[None, :] * s  # fp32: the no-dot path's operand dtype
            else:
                normed = (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
                x = (nw.to(tl.float32)[None, :] * normed).to(x.dtype)
        if USE_DOT:
            acc_g = tl.dot(x, tl.trans(g), acc_g)
            if GATED:
                acc_u = tl.dot(x, tl.trans(u), acc_u)
        else:
            xf = x.to(tl.float32)  # [1, BLOCK_K]
            acc_g2 += g.to(tl.float32) * xf
            if GATED:
                acc_u2 += u.to(tl.float32) * xf
        g_ptrs += BLOCK_K
        if GATED:
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not USE_DOT:
        acc_g = tl.reshape(tl.sum(acc_g2, axis=1), [BLOCK_M, BLOCK_N])
        if GATED:
            acc_u = tl.reshape(tl.sum(acc_u2, axis=1), [BLOCK_M, BLOCK_N])
    if HAS_NORM and ONE_PASS:
        inv = tl.rsqrt(tl.sum(squares2, axis=1) / K + eps)[:, None]  # [BLOCK_M, 1]
        acc_g = acc_g * inv
        if GATED:
            acc_u = acc_u * inv
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if GATED:
        # The GEMM's rounding to the output dtype, as linear then silu_and_mul would round.
        gate = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptrs, gate / (1.0 + tl.exp(-gate)) * up, mask=out_mask)
    else:
        tl.store(out_ptrs, acc_g, mask=out_mask)


def default_config(
    num_rows: int, interpreted: bool, gated: bool = True, k: int = 0, n: int = 0
) -> SkinnyConfig:
    """Tiles for [num_rows, K] x [2N, K]^T. Each program streams two [BLOCK_N, BLOCK_K] W tiles
    per step. Not ``gated`` (one W stream): the plain kernel's own defaults.

    NOTE (benchmarks/tune_gated_linear.py, one H100, triton 3.6, torch 2.11, 2026-11-24,
    results/s10-h100/tune-gated-linear.json; gate_up with SiLU-and-mul against cuBLAS's GEMM plus
    silu_and_mul): Qwen3-0.6B (K=1024) one row 4 x 512 multiply-adds, 4 stages, 6.9 us (the
    first guess 8 x 512 / 5 stages 7.2, unfused 8.9); 4-8 rows 32 x 128 dots, 4 stages, 7.0 us
    (16 x 128: 8.4). Llama-3-8B (K=4096) one row 78.6 us (80.5, unfused 85.5); 4-8 rows 32 x 256
    dots, 3 stages, 80.9-81.3 us (87.1-87.4, unfused 84.1-84.6). A dot's BLOCK_N stays >= 16
    (the MMA's smallest N).
    """
    if interpreted:
        return SkinnyConfig(16, 32, 4, 1, use_dot=num_rows > 1)
    if not gated:
        if num_rows == 1 and linear.one_row_config(n, k) is not None:  # the plain kernel's
            return dataclasses.replace(linear.one_row_config(n, k), split_k=1)  # (no split here)
        return (
            SkinnyConfig(16, 512, 4, 5, use_dot=False)
            if num_rows == 1
            else SkinnyConfig(32, 128, 4, 5)
        )
    if num_rows == 1:
        return SkinnyConfig(4, 512, 4, 4, use_dot=False)
    return SkinnyConfig(32, 256, 4, 3) if k >= 4096 else SkinnyConfig(32, 128, 4, 4)


def gated_skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """The fused kernel on x [..., K], weight [2N, K], bias [2N] or None -> [..., N], for any row
    count <= 16 (tests call it directly; ``takes`` says where models get it)."""
    return _launch(x, None, weight, bias, config, gated=True)


def norm_gated_skinny_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` then the fused kernel, in one launch: x, residual [..., K],
    norm_weight [K] -> (out [..., N], x + residual [..., K])."""
    return _launch(x, (residual, norm_weight, float(eps)), weight, bias, config, gated=True)


def norm_skinny_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``fused_add_``)``rms_norm`` then a plain GEMM, in one launch: x, residual (or None)
    [..., K], norm_weight [K], weight [N, K] -> (out [..., N], x + residual (x) [..., K])."""
    return _launch(x, (residual, norm_weight, float(eps)), weight, bias, config, gated=False)


def _launch(x, norm, weight, bias, config, gated: bool):
    rows_w, k = weight.shape
    n = rows_w // 2 if gated else rows_w
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    residual = None if norm is None else norm[0]
    res_out = None
    if residual is not None:
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    done = out if norm is None else (out, x if residual is None else res_out)
    if out.numel() == 0 or k == 0:
        if out.numel() and k == 0:  # no products: the biases alone (or zeros), on every row
            b = x.new_zeros(rows_w) if bias is None else bias
            if gated:
                gate, up = b.float().chunk(2)
                b = torch.nn.functional.silu(gate) * up
            out.copy_(b.expand_as(out))
        return done
    x2 = as_rows(x)
    num_rows = x2.shape[0]
    if num_rows > 16:
        raise ValueError(f"gated_skinny_linear: x has {num_rows} rows; the kernel takes <= 16")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2, norm_weight, eps, ro2 = x2, weight, 0.0, x2  # unused without a norm / a residual
    if norm is not None:
        _, norm_weight, eps = norm
        norm_weight = norm_weight if norm_weight.stride(0) == 1 else norm_weight.contiguous()
    if residual is not None:
        r2 = as_rows(residual)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        ro2 = res_out.view(-1, k)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    config = config or default_config(num_rows, is_interpreted(x.device), gated, k, n)
    use_dot = config.use_dot or num_rows > 1
    block_n = max(config.block_n, 16) if use_dot else config.block_n  # an MMA's N >= 16
    out2 = out.view(-1, n)
    use_pdl = pdl.enabled(x.device)
    _gated_skinny_kernel[(triton.cdiv(n, block_n),)](
        x2,
        weight,
        bias if bias is not None else weight,
        out2,
        r2,
        norm_weight,
        ro2,
        eps,
        num_rows,
        n,
        k,
        x2.stride(0),
        r2.stride(0),
        weight.stride(0),
        out2.stride(0),
        ro2.stride(0),
        GATED=gated,
        HAS_BIAS=bias is not None,
        HAS_NORM=norm is not None,
        HAS_RESIDUAL=residual is not None,
        USE_DOT=use_dot,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=16 if use_dot else 1,
        BLOCK_N=block_n,
        BLOCK_K=config.block_k,
        USE_PDL=use_pdl,
        LINE=pdl.line_elements(weight),
        LINES=pdl.PREFETCH_LINES,
        ONE_PASS=norm is not None
        and not use_dot
        and (NORM_ONE_PASS if gated else NORM_ONE_PASS_LINEAR),
        PREFETCH=config.prefetch and not use_dot and k % config.block_k == 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return done


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused kernel runs this gate/up GEMM (see the module docstring)."""
    if not ENABLED or is_interpreted(x.device) or x.dtype == torch.float32:
        return False
    return 0 < math.prod(x.shape[:-1]) <= SKINNY_MAX_ROWS


# The norm fusions take rows of at most this many features: every program reads its row (and
# the residual) once more, from L2, for the statistics before its weights stream.
# NOTE (engine_bench.py decode, one H100, triton 3.6, 2026-11-24, results/s10-h100/decode-*,
# two alternating rounds): all three fusions took Qwen3-0.6B's (hidden 1024) batch-1 step from
# 1.42 to 1.32-1.34 ms, but Llama-3-8B's (hidden 4096) from 6.15 to 6.48-6.49 ms.
# ATOM_NORM_MAX_FEATURES overrides it (A/B at hidden 4096 with PDL and ATOM_NORM_ONE_PASS).
NORM_MAX_FEATURES = envs.ATOM_NORM_MAX_FEATURES


def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused kernel also runs the residual add + RMSNorm before it: one row of at
    most NORM_MAX_FEATURES features (every program reads it twice, from L2, for the statistics
    and the operand)."""
    return (
        NORM_ENABLED
        and takes(x, weight)
        and math.prod(x.shape[:-1]) == 1
        and x.shape[-1] <= NORM_MAX_FEATURES
    )


# The input norm + QKV fusion takes rows of at most this many features.
# NOTE (benchmarks/decode_ab.sh, one H100, triton 3.6, torch 2.11, PDL on, 2026-11-24,
# results/s12-h100/h17a-call1, two alternating rounds, Llama-3-8B batch 1, ms a step): both
# norms fused at hidden 4096 in one pass 5.875 / 5.880 against 5.826 / 5.822 unfused (gate/up's
# 3,584 programs each read x, the residual and the norm weight from L2: 86 MB a layer), the
# input norm + QKV alone 5.807 / 5.817. The gate/up fusion keeps NORM_MAX_FEATURES (two passes).
# With the narrow one-row tiles (results/s12-h100/h17a-call2): Llama-3-8B 5.605 fused against
# 5.608 / 5.614 unfused; Qwen3-0.6B (hidden 1024) 1.125 / 1.128 one pass against 1.138 / 1.142
# two passes.
NORM_LINEAR_MAX_FEATURES = envs.ATOM_NORM_LINEAR_MAX_FEATURES


def takes_norm_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the norm + plain GEMM kernel runs (the input norm and QKV projection): one row
    of at most NORM_LINEAR_MAX_FEATURES features (NORM_MAX_FEATURES without the one-pass
    kernel)."""
    if not NORM_LINEAR_ENABLED or is_interpreted(x.device) or x.dtype == torch.float32:
        return False
    limit = NORM_LINEAR_MAX_FEATURES if NORM_ONE_PASS_LINEAR else NORM_MAX_FEATURES
    return math.prod(x.shape[:-1]) == 1 and x.shape[-1] <= limit
