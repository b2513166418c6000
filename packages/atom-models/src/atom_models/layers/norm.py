from __future__ import annotations

import torch
from torch import nn

import atom_kernels


class RMSNorm(nn.Module):
    """RMSNorm; given a residual, adds it first and returns (normed, new residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return atom_kernels.rms_norm(x, self.weight, self.eps)
        return atom_kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
