"""Torch reference: dense linear (cuBLAS on GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
