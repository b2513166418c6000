from __future__ import annotations

import torch
from torch import nn

import atom_kernels


class SiluAndMul(nn.Module):
    """[..., 2N] -> silu(x[..., :N]) * x[..., N:]"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return atom_kernels.silu_and_mul(x)


class GeluAndMul(nn.Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return atom_kernels.gelu_and_mul(x, approximate=self.approximate)
