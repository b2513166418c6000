"""Torch reference: dense linear (cuBLAS on GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.backends.torch.norm import fused_add_rms_norm, rms_norm
from atom_kernels.registry import register_op


@register_op("linear", "torch")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@register_op("linear_silu_and_mul", "torch")
def linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    gate, up = F.linear(x, weight, bias).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@register_op("fused_add_rms_norm_linear_silu_and_mul", "torch")
def fused_add_rms_norm_linear_silu_and_mul(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, new_residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear_silu_and_mul(normed, weight, bias), new_residual


@register_op("rms_norm_linear", "torch")
def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), residual
