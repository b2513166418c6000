"""Torch reference: W8A8 INT8 and WNA16 linear layers (layouts: ``atom_kernels.ops.int_quant``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops.int_quant_frag import is_frag, wna16_from_frag
from atom_kernels.registry import register_op


def quantize_int8_per_token(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, 1]): symmetric, per token unless a static
    per-tensor scale is given."""
    xf = x.float()
    if input_scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
        # Divided by a tensor, not the number 127.0: on CUDA, torch divides by a Python scalar as
        # a multiply by its rounded reciprocal (ATen's div_true_kernel_cuda), 1 ulp off the
        # quotient for ~5% of bf16 amaxes (0.55859375, 1.1171875, ...): the scale then differs
        # from the CPU's and the kernels' (IEEE division) and a code at a rounding tie flips
        # (test_int8_linear_gpu_real_sizes: 1 bf16 ulp in ~1/5 of the outputs of such a row).
        scale = amax / torch.full_like(amax, 127.0)  # a fill on the device: graph-capturable
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8)
    return q, scale


@register_op("int8_linear", "torch")
def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    shape = x.shape
    q, x_scale = quantize_int8_per_token(x.reshape(-1, shape[-1]), input_scale)
    # float64 holds every int32 sum exactly (|sum| < 2**31 for K < 2**17).
    acc = q.double() @ weight.double().t()
    y = (acc * x_scale.double() * weight_scale.double()[None, :]).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


def unpack_int32(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """int32 words -> unsigned `bits`-bit values (int32), 32 / bits of them a word along `dim`,
    the lowest bits first."""
    per_int = 32 // bits
    p = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(per_int, device=p.device, dtype=torch.int32) * bits
    values = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*p.shape[:-1], p.shape[-1] * per_int).movedim(-1, dim)


@register_op("dequantize_wna16", "torch")
def dequantize_wna16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    if is_frag(qweight):  # the fragment layout: its permutation undone (the same values)
        qweight, scales, zeros = wna16_from_frag(qweight, scales, zeros)
    q = unpack_int32(qweight, bits).float()  # [..., N, K]
    k, groups = q.shape[-1], scales.shape[-1]
    if g_idx is None:
        g_idx = torch.arange(k, device=q.device) // (k // groups)
    g_idx = g_idx.long()
    scale = scales.float()[..., g_idx]
    zero = 2.0 ** (bits - 1) if zeros is None else zeros.float()[..., g_idx]
    return ((q - zero) * scale).to(dtype)


@register_op("wna16_linear", "torch")
def wna16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    weight = dequantize_wna16(qweight, scales, zeros, g_idx, bits, x.dtype)
    return F.linear(x, weight, bias)
