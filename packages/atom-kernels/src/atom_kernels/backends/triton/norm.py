"""Triton RMSNorm and fused residual-add + RMSNorm: ROWS rows per program (a [ROWS, BLOCK_N]
block, each row's statistics in fp32 over its own columns), one by default."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.torch import norm as reference
from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.common import (
    MAX_FUSED_SIZE,
    as_rows,
    next_pow2,
    row_num_warps,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_rows,
    num_cols,
    eps,
    stride_xm,
    stride_xn,
    stride_rm,
    stride_rn,
    stride_w,
    stride_om,
    stride_rom,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # launched early behind the previous kernel (pdl.py): nothing read before this
        pdl.wait_for_previous()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < num_rows) & (cols < num_cols)
    x = tl.load(x_ptr + rows * stride_xm + cols * stride_xn, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows * stride_rm + cols * stride_rn, mask=mask, other=0.0)
        # The sum rounds to the input dtype (as `x + residual` does in torch) before the norm.
        x = (x + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows * stride_rom + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=1)[:, None] / num_cols
    # HF rounding: the normalized row goes to the input dtype, then the weight multiplies it.
    normed = (x * tl.math.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols * stride_w, mask=cols < num_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_om + cols, w * normed, mask=mask)


def _launch(x, residual, weight, eps, config: dict | None = None):
    """``config`` (benchmarks): ``ROWS`` rows a program and ``num_warps`` instead of the
    defaults (one row, ``row_num_warps``); ``INPLACE``: the outputs overwrite x and residual
    (contiguous rows; FlashInfer's form: a program reads its rows whole before it stores)."""
    num_cols = x.shape[-1]
    if (config or {}).get("INPLACE"):
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            raise ValueError("norm: INPLACE needs contiguous x and residual")
        out, residual_out = x, residual
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        residual_out = torch.empty_like(out) if residual is not None else None
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else x2
    out2 = out.view(-1, num_cols)
    rout2 = residual_out.view(-1, num_cols) if residual_out is not None else out2
    num_rows = x2.shape[0]
    if num_rows == 0 or num_cols == 0:
        if residual_out is not None:
            residual_out.copy_(x + residual)
        return out, residual_out
    block = next_pow2(num_cols)
    use_pdl = pdl.enabled(x.device)
    cfg = {"ROWS": 1, "num_warps": row_num_warps(block), **(config or {})}
    cfg.pop("INPLACE", None)
    _rms_norm_kernel[(triton.cdiv(num_rows, cfg["ROWS"]),)](
        x2,
        r2,
        weight,
        out2,
        rout2,
        num_rows,
        num_cols,
        eps,
        x2.stride(0),
        x2.stride(1),
        r2.stride(0),
        r2.stride(1),
        weight.stride(0),
        out2.stride(0),
        rout2.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block,
        ROWS=cfg["ROWS"],
        USE_PDL=use_pdl,
        num_warps=cfg["num_warps"],
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in x's dtype (see atom_kernels.rms_norm)."""
    if x.shape[-1] > MAX_FUSED_SIZE:
        return reference.rms_norm(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both new tensors of x's shape and dtype."""
    if x.shape[-1] > MAX_FUSED_SIZE:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """fused_add_rms_norm in place: residual <- x + residual, x <- its norm. Contiguous rows are
    written by the kernel where it read them (each program reads its row whole before storing);
    other layouts are computed out of place and copied back."""
    if x.shape[-1] > MAX_FUSED_SIZE or not (x.is_contiguous() and residual.is_contiguous()):
        normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
        residual.copy_(new_residual)
        x.copy_(normed)
        return
    _launch(x, residual, weight, eps, {"INPLACE": True})
