"""Triton gated activations: SiLU-and-mul and GELU-and-mul (erf / tanh), fp32 math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import as_rows, next_pow2
from atom_kernels.backends.triton.jit_utils import tanh

_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _gated_kernel(
    x_ptr,
    out_ptr,
    num_cols,
    stride_xm,
    stride_xn,
    stride_om,
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gelu (erf), 2 gelu (tanh)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    x_row = x_ptr + row * stride_xm
    gate = tl.load(x_row + cols * stride_xn, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + (cols + num_cols) * stride_xn, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
        act = 0.5 * gate * (1.0 + tanh(inner))
    tl.store(out_ptr + row * stride_om + cols, act * up, mask=mask)


def _gated(x: torch.Tensor, activation: str) -> torch.Tensor:
    num_cols = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], num_cols), dtype=x.dtype, device=x.device)
    x2 = as_rows(x)
    out2 = out.view(-1, num_cols)
    if x2.shape[0] == 0 or num_cols == 0:
        return out
    block = min(next_pow2(num_cols), 1024)
    grid = (x2.shape[0], triton.cdiv(num_cols, block))
    _gated_kernel[grid](
        x2,
        out2,
        num_cols,
        x2.stride(0),
        x2.stride(1),
        out2.stride(0),
        ACTIVATION=_ACTIVATIONS[activation],
        BLOCK=block,
        num_warps=4 if block >= 512 else 2,
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2N] -> silu(x[..., :N]) * x[..., N:] [..., N]."""
    return _gated(x, "silu")


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """x [..., 2N] -> gelu(x[..., :N], approximate) * x[..., N:] [..., N]."""
    return _gated(x, "gelu" if approximate == "none" else "gelu_tanh")
