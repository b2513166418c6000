"""Gated activations: SiLU-and-mul (SwiGLU) and GELU-and-mul (GeGLU)."""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, check_tensor
from atom_kernels.registry import get_op


def _check_gated(op: str, x: torch.Tensor) -> None:
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise ValueError(
            f"{op}: x has shape {tuple(x.shape)}; its last dim must be even ([gate | up], 2N)"
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2N] -> ``silu(x[..., :N]) * x[..., N:]`` [..., N] in x's dtype (fp32 math)."""
    _check_gated("silu_and_mul", x)
    return get_op("silu_and_mul", x.device)(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x: [..., 2N] -> ``gelu(x[..., :N], approximate) * x[..., N:]`` [..., N] (fp32 math).

    approximate: "none" (erf) or "tanh", as ``torch.nn.functional.gelu``.
    """
    _check_gated("gelu_and_mul", x)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu_and_mul: approximate must be 'none' or 'tanh', got {approximate!r}")
    return get_op("gelu_and_mul", x.device)(x, approximate)
