"""Torch reference: dequantization, FP8 activation quantization and the quantized GEMMs as the
dequantized model (dequantize in float32, cast to the activation dtype, then ``F.linear``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.registry import register_op

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP_QUANT_EPS = 1e-10  # floor of a group's max |x| (an all-zero group gets a tiny scale)
# e2m1 code -> value (sign bit 3, exponent bits 2-1, mantissa bit 0), as transformers' FP4_VALUES
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip


def expand_block_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]):
    """scale [..., ceil(N / bn), ceil(K / bk)] -> [..., N, K] (each block's scale repeated)."""
    n, k = shape[-2:]
    rows = scale.repeat_interleave(block[0], dim=-2)[..., :n, :]
    return rows.repeat_interleave(block[1], dim=-1)[..., :k]


@register_op("dequantize_fp8_block", "torch")
def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    return (weight.float() * expand_block_scale(scale.float(), weight.shape, block)).to(dtype)


def dequantize_fp8_channel(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """weight [..., N, K] times scale [..., N] (per output row), in float32, cast to dtype."""
    return (weight.float() * scale.float()[..., None]).to(dtype)


@register_op("dequantize_mxfp4", "torch")
def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    # G = scale blocks; a block is 16 bytes = 32 values, low nibble first
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0xF).long()]  # [..., G, 16]
    high = lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    # ldexp in float32: exactly transformers' ``torch.ldexp`` (a power of two, one rounding)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.to(dtype).flatten(-2)  # [..., G * 32]


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fused-MoE MXFP4 weight: uint8 [..., N, K / 2] packed along K, scales [..., N, K / 32]
    -> [..., N, K] in dtype."""
    grouped = blocks.unflatten(-1, (scales.shape[-1], blocks.shape[-1] // scales.shape[-1]))
    return dequantize_mxfp4(grouped, scales, dtype)


@register_op("per_token_group_quant_fp8", "torch")
def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # M = rows, K = columns, G = groups per row (the last one may be partial)
    num_rows, k = x.shape
    num_groups = -(-k // group_size)
    padded = F.pad(x.float(), (0, num_groups * group_size - k))  # zeros do not change a max
    groups = padded.view(num_rows, num_groups, group_size)  # [M, G, group]
    amax = groups.abs().amax(dim=-1).clamp(min=GROUP_QUANT_EPS)  # [M, G]
    # NOTE: a tensor divisor, not the scalar: CUDA torch divides by a scalar as a multiply by its
    # reciprocal (not IEEE division), which gave 9,900 of 16,800 scales 1 ulp off the Triton
    # kernel's div_rn and flipped 2,672 fp8 values (H100, torch 2.11, 300 x 7168 bf16).
    scale = amax / torch.full_like(amax, FP8_MAX)
    x_q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.view(num_rows, -1)[:, :k].contiguous(), scale


@register_op("fp8_block_linear", "torch")
def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return F.linear(x, dequantize_fp8_block(weight, scale, block, x.dtype), bias)


@register_op("fp8_linear", "torch")
def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return F.linear(x, dequantize_fp8_channel(weight, weight_scale, x.dtype), bias)
