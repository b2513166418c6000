"""Dense linear layer: ``y = x W^T (+ b)``."""

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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear``: x [..., K], weight [N, K], bias [N] or None -> [..., N].

    All in one float dtype. The torch backend is cuBLAS (``F.linear``); the Triton backend streams
    the weight through its own kernel when x has only a few rows (batch-1..8 decode) and keeps
    cuBLAS otherwise.
    """
    op = "linear"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    _check_weight(op, x, weight, bias)
    return get_op(op, x.device)(x, weight, bias)


def linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight, bias))``: a gated MLP's gate/up projection and activation.

    x [..., K], weight [2N, K] (N gate rows, then N up rows), bias [2N] or None -> [..., N], all in
    one float dtype. The GEMM's output is rounded to x's dtype before the activation (fp32 math),
    as the two ops in a row would. The Triton backend runs both in one kernel when x has only a
    few rows (batch-1 decode); elsewhere it is the two ops.
    """
    op = "linear_silu_and_mul"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    _check_gated_weight(op, x, weight, bias)
    return get_op(op, x.device)(x, weight, bias)


def _check_gated_weight(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    check_tensor(op, "weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_dim(op, "weight", weight, 1, x.shape[-1], "to match x's last dim")
    if weight.shape[0] % 2:
        raise ValueError(
            f"{op}: weight has shape {tuple(weight.shape)}; its rows must be even ([gate | up], 2N)"
        )
    check_same_dtype(op, "x", x, weight=weight)
    check_same_device(op, "x", x, weight=weight, bias=bias)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
        check_dim(op, "bias", bias, 0, weight.shape[0], "to match weight's rows")
        check_same_dtype(op, "x", x, bias=bias)


def fused_add_rms_norm_linear_silu_and_mul(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` then ``linear_silu_and_mul``: a decoder layer's post-attention norm
    and its gated MLP's first half.

    x, residual [..., K]; norm_weight [K]; weight [2N, K] (gate rows, then up rows); bias [2N] or
    None -> (out [..., N], x + residual [..., K]), with the two ops' roundings. The Triton backend
    runs all of it in one kernel at one row (batch-1 decode); elsewhere it is the two ops.
    """
    op = "fused_add_rms_norm_linear_silu_and_mul"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor(op, "residual", residual, dtypes=FLOAT_DTYPES)
    check_shape(op, "residual", residual, tuple(x.shape), "to match x")
    _check_norm_weight(op, x, norm_weight, eps)
    _check_gated_weight(op, x, weight, bias)
    check_same_dtype(op, "x", x, residual=residual)
    check_same_device(op, "x", x, residual=residual)
    return get_op(op, x.device)(x, residual, norm_weight, float(eps), weight, bias)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` (``fused_add_rms_norm`` given a residual) then ``linear``: a decoder layer's
    input norm and its QKV projection.

    x, residual (or None) [..., K]; norm_weight [K]; weight [N, K]; bias [N] or None ->
    (out [..., N], the new residual: x + residual, or x itself without one), with the two ops'
    roundings. The Triton backend runs both in one kernel at one row (batch-1 decode).
    """
    op = "rms_norm_linear"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    if residual is not None:
        check_tensor(op, "residual", residual, dtypes=FLOAT_DTYPES)
        check_shape(op, "residual", residual, tuple(x.shape), "to match x")
        check_same_dtype(op, "x", x, residual=residual)
        check_same_device(op, "x", x, residual=residual)
    _check_norm_weight(op, x, norm_weight, eps)
    _check_weight(op, x, weight, bias)
    return get_op(op, x.device)(x, residual, norm_weight, float(eps), weight, bias)


def _check_weight(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """weight [N, K] for x [..., K], bias [N] or None: x's dtype and device."""
    check_tensor(op, "weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_dim(op, "weight", weight, 1, x.shape[-1], "to match x's last dim")
    check_same_dtype(op, "x", x, weight=weight)
    check_same_device(op, "x", x, weight=weight, bias=bias)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
        check_dim(op, "bias", bias, 0, weight.shape[0], "to match weight's rows")
        check_same_dtype(op, "x", x, bias=bias)


def _check_norm_weight(op: str, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> None:
    check_tensor(op, "norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES)
    check_dim(op, "norm_weight", norm_weight, 0, x.shape[-1], "to match x's last dim")
    check_same_device(op, "x", x, norm_weight=norm_weight)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}")
