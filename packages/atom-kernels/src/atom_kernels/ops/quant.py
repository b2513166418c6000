"""Quantized weights: dequantization, FP8 activation quantization and FP8 GEMMs.

Formats (N = output features, K = input features, M = rows of x):

- FP8 block (DeepSeek-V3, Qwen3-FP8): float8_e4m3fn weight [N, K] and float32 ``weight_scale_inv``
  [ceil(N / bn), ceil(K / bk)], one scale per [bn, bk] block (edge blocks may be partial).
- FP8 per channel / per tensor (compressed-tensors, ModelOpt): float8_e4m3fn weight [N, K] and a
  float32 scale per output row [N] (a per-tensor scale expanded to [N] by the caller).
- MXFP4 (GPT-OSS): uint8 blocks [..., G, 16] holding two e2m1 values a byte (low nibble first) and
  uint8 e8m0 scales [..., G] (2 ** (scale - 127)), one per 32 values.

The torch backend computes exactly the dequantized model (dequantize in float32, cast to the
activation dtype, then the dense op); the Triton backend quantizes activations to FP8 (w8a8) for
the GEMMs, within a stated tolerance of that (see tests/test_triton_quant.py).
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import (
    FLOAT_DTYPES,
    check_dim,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from atom_kernels.registry import get_op

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MXFP4_BLOCK = 32  # values per e8m0 scale


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_block_size(op: str, block_size: object) -> tuple[int, int]:
    """``block_size`` as (bn, bk): a pair of positive ints."""
    if (
        not isinstance(block_size, (tuple, list))
        or len(block_size) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size)
    ):
        raise ValueError(
            f"{op}: block_size must be a pair of positive ints (block_n, block_k), "
            f"got {block_size!r}"
        )
    return int(block_size[0]), int(block_size[1])


def check_fp8_weight(op: str, name: str, weight: object, ndim: int) -> torch.Tensor:
    return check_tensor(op, name, weight, ndim=ndim, dtypes=(FP8_DTYPE,))


def check_block_scale(
    op: str,
    name: str,
    scale: object,
    weight: torch.Tensor,
    block: tuple[int, int],
    weight_name: str,
) -> None:
    """A block scale grid: float32 [..., ceil(N / bn), ceil(K / bk)] for weight [..., N, K]."""
    check_tensor(op, name, scale, ndim=weight.dim(), dtypes=(torch.float32,))
    *lead, n, k = weight.shape
    grid = (*lead, cdiv(n, block[0]), cdiv(k, block[1]))
    check_shape(
        op, name, scale, grid,
        f"(ceil-div of {weight_name}'s shape {tuple(weight.shape)} by block_size {block})",
    )  # fmt: skip


def check_mxfp4(op: str, blocks_name: str, blocks: object, scales_name: str, scales: object,
                ndim: int | None = None) -> None:  # fmt: skip
    """uint8 packed blocks [..., G, 16] and uint8 e8m0 scales [..., G]."""
    check_tensor(op, blocks_name, blocks, ndim=ndim, min_ndim=2, dtypes=(torch.uint8,))
    check_tensor(op, scales_name, scales, dtypes=(torch.uint8,))
    check_dim(op, blocks_name, blocks, -1, MXFP4_BLOCK // 2, "(16 bytes: 32 e2m1 values a block)")
    check_shape(
        op, scales_name, scales, tuple(blocks.shape[:-1]), f"(one e8m0 scale per block of "
        f"{blocks_name} {tuple(blocks.shape)})",
    )  # fmt: skip


def dequantize_fp8_block(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int] | list[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """weight float8_e4m3fn [..., N, K] times its per-block scale, computed in float32, cast to
    ``dtype`` (what transformers' FineGrainedFP8 ``dequantize=True`` loads).

    weight_scale_inv: float32 [..., ceil(N / bn), ceil(K / bk)]; block_size: (bn, bk). Edge blocks
    may be partial (N = 576 with bn = 128).
    """
    op = "dequantize_fp8_block"
    block = check_block_size(op, block_size)
    check_tensor(op, "weight", weight, min_ndim=2, dtypes=(FP8_DTYPE,))
    check_block_scale(op, "weight_scale_inv", weight_scale_inv, weight, block, "weight")
    check_same_device(op, "weight", weight, weight_scale_inv=weight_scale_inv)
    _check_out_dtype(op, dtype)
    return get_op(op, weight.device)(weight, weight_scale_inv, block, dtype)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """MXFP4 -> ``dtype``: blocks uint8 [..., G, 16] (two e2m1 values a byte, low nibble first),
    scales uint8 e8m0 [..., G] (2 ** (scale - 127)) -> [..., G * 32] (transformers'
    ``convert_moe_packed_tensors`` before its transpose)."""
    op = "dequantize_mxfp4"
    check_mxfp4(op, "blocks", blocks, "scales", scales)
    check_same_device(op, "blocks", blocks, scales=scales)
    _check_out_dtype(op, dtype)
    return get_op(op, blocks.device)(blocks, scales, dtype)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of x [M, K] in groups of ``group_size`` columns per row.

    scale = max(|group|, 1e-10) / 448 (float32), x_q = clamp(x / scale, -448, 448) rounded to
    float8_e4m3fn. Returns (x_q float8_e4m3fn [M, K], x_s float32 [M, ceil(K / group_size)]); the
    last group may be partial.
    """
    op = "per_token_group_quant_fp8"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"{op}: group_size must be a positive int, got {group_size!r}")
    return get_op(op, x.device)(x, group_size)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int] | list[int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b) with a block-FP8 weight: x [..., K] float, weight float8_e4m3fn [N, K],
    weight_scale_inv float32 [ceil(N / bn), ceil(K / bk)], block_size (bn, bk), bias [N] in x's
    dtype or None. Returns [..., N] in x's dtype.

    torch: ``F.linear(x, dequantize_fp8_block(...), bias)`` (the dequantized model). Triton: w8a8,
    x quantized per token and per 1 x bk group (``per_token_group_quant_fp8``), then a block-FP8
    GEMM accumulating in float32 with both scales applied per K block.
    """
    op = "fp8_block_linear"
    block = check_block_size(op, block_size)
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_fp8_weight(op, "weight", weight, 2)
    check_dim(op, "weight", weight, 1, x.shape[-1], "to match x's last dim (K)")
    check_block_scale(op, "weight_scale_inv", weight_scale_inv, weight, block, "weight")
    _check_bias(op, x, weight, bias)
    check_same_device(op, "x", x, weight=weight, weight_scale_inv=weight_scale_inv, bias=bias)
    return get_op(op, x.device)(x, weight, weight_scale_inv, block, bias)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b) with an FP8 weight scaled per output channel: x [..., K] float, weight
    float8_e4m3fn [N, K], weight_scale float32 [N] (a per-tensor scale expanded to [N]),
    input_scale None (dynamic per-token activation scales) or a float32 one-element tensor (static
    per-tensor), bias [N] in x's dtype or None. Returns [..., N] in x's dtype.

    torch: ``F.linear(x, (weight.float() * weight_scale[:, None]).to(x.dtype), bias)`` (the
    dequantized model; input_scale unused). Triton: x quantized to FP8 per token (dynamic) or with
    input_scale (static), then ``torch._scaled_mm`` with row-wise scales where the GPU has FP8
    (compute capability >= 8.9), a Triton w8a8 GEMM elsewhere.
    """
    op = "fp8_linear"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_fp8_weight(op, "weight", weight, 2)
    check_dim(op, "weight", weight, 1, x.shape[-1], "to match x's last dim (K)")
    check_tensor(op, "weight_scale", weight_scale, ndim=1, dtypes=(torch.float32,))
    check_shape(op, "weight_scale", weight_scale, (weight.shape[0],), "(one per output row of "
                "weight; expand a per-tensor scale to [N])")  # fmt: skip
    if input_scale is not None:
        check_tensor(op, "input_scale", input_scale, dtypes=(torch.float32,))
        if input_scale.numel() != 1:
            raise ValueError(
                f"{op}: input_scale must be per-tensor (one element), got shape "
                f"{tuple(input_scale.shape)}"
            )
    _check_bias(op, x, weight, bias)
    check_same_device(
        op, "x", x, weight=weight, weight_scale=weight_scale, input_scale=input_scale, bias=bias
    )
    return get_op(op, x.device)(x, weight, weight_scale, input_scale, bias)


def _check_bias(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
        check_dim(op, "bias", bias, 0, weight.shape[0], "to match weight's rows (N)")
        check_same_dtype(op, "x", x, bias=bias)


def _check_out_dtype(op: str, dtype: object) -> None:
    if dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise ValueError(f"{op}: dtype must be one of {names}, got {dtype!r}")
