"""Torch reference: RMSNorm and fused residual-add + RMSNorm."""

from __future__ import annotations

import torch

from atom_kernels.registry import register_op


@register_op("rms_norm", "torch")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    # weight * normed in fp32 then one rounding == HF's `weight * normed` when dtypes agree.
    return (weight.float() * normed.float()).to(x.dtype)


@register_op("fused_add_rms_norm", "torch")
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


@register_op("fused_add_rms_norm_", "torch")
def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    residual.copy_(new_residual)
    x.copy_(normed)
