"""RMSNorm and fused residual-add + RMSNorm (HF Llama semantics)."""

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


def _check_weight(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_tensor(op, "weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    check_dim(op, "weight", weight, 0, x.shape[-1], "to match x's last dim")
    check_same_device(op, "x", x, weight=weight)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``weight * (x / sqrt(mean(x**2) + eps))``.

    x: [..., N] fp32/bf16/fp16; weight: [N] (any of those dtypes). Returns a new tensor of x's
    shape and dtype. Statistics in fp32; the normalized x is rounded to x's dtype before the weight
    multiply, as HF's LlamaRMSNorm does.
    """
    check_tensor("rms_norm", "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    _check_weight("rms_norm", x, weight, eps)
    return get_op("rms_norm", x.device)(x, weight, float(eps))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (in x's dtype); returns
    ``(rms_norm(new_residual, weight, eps), new_residual)``.

    x, residual: [..., N], same shape and dtype; weight: [N]. Functional: inputs are not modified.
    """
    op = "fused_add_rms_norm"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor(op, "residual", residual, dtypes=FLOAT_DTYPES)
    check_shape(op, "residual", residual, tuple(x.shape), "to match x")
    check_same_dtype(op, "x", x, residual=residual)
    check_same_device(op, "x", x, residual=residual)
    _check_weight(op, x, weight, eps)
    return get_op(op, x.device)(x, residual, weight, float(eps))


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """``fused_add_rms_norm`` in place (vLLM's ``fused_add_rms_norm`` convention): ``residual``
    becomes ``x + residual`` and ``x`` its RMSNorm. Same arguments; returns None.

    Writing where the inputs are saves the two new tensors' allocation and, on a GPU, the traffic
    of writing them next to the inputs still in L2 (the form FlashInfer's kernel has).
    """
    op = "fused_add_rms_norm_"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor(op, "residual", residual, dtypes=FLOAT_DTYPES)
    check_shape(op, "residual", residual, tuple(x.shape), "to match x")
    check_same_dtype(op, "x", x, residual=residual)
    check_same_device(op, "x", x, residual=residual)
    _check_weight(op, x, weight, eps)
    if x.data_ptr() == residual.data_ptr() and x.numel():
        raise ValueError(f"{op}: x and residual must not share memory")
    get_op(op, x.device)(x, residual, weight, float(eps))
