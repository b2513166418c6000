"""Torch reference: gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.registry import register_op


@register_op("silu_and_mul", "torch")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@register_op("gelu_and_mul", "torch")
def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate=approximate) * up).to(x.dtype)
