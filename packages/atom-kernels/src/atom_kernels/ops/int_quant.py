"""Integer-quantized linear layers: INT8 weights with INT8 activations (W8A8), and 4- or 8-bit
weights packed in int32 with 16-bit (or fp32) activations (WNA16: GPTQ, AWQ, compressed-tensors
pack-quantized, all repacked at load into the one layout below).

WNA16 layout (``qweight``): int32 [N, K * bits / 32]; along each row, 32 / bits consecutive values
of k per int32, the lowest bits first; values unsigned in 0 .. 2**bits - 1. ``scales`` [N, G] in
the activation dtype, G groups along K (group g covers k in [g * K / G, (g + 1) * K / G); G = 1 is
channel-wise). ``zeros`` None (symmetric: the zero point is 2**(bits - 1)) or [N, G] in the
scales' dtype, holding integer values. ``g_idx`` None or int32 [K]: the group of each k (GPTQ's
``desc_act``), overriding the contiguous groups. The weight is ``(q - zero) * scale``.
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
from atom_kernels.ops.int_quant_frag import FRAG_ROWS, FRAG_STEP, is_frag
from atom_kernels.registry import get_op

WNA16_BITS = (4, 8)


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b), W8A8: x [..., K] float; weight int8 [N, K]; weight_scale float32 [N] (a
    per-tensor scale expanded to [N]); input_scale None (x quantized per token:
    scale = max|x_row| / 127) or a float32 one-element tensor (static per-tensor); bias [N] in x's
    dtype or None. Returns [..., N] in x's dtype.

    x is quantized symmetrically, ``clamp(round(x / scale), -128, 127)``; the int8 products are
    summed exactly (int32), then scaled by the row's and the channel's scales in float32.
    """
    op = "int8_linear"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor(op, "weight", weight, ndim=2, dtypes=(torch.int8,))
    check_dim(op, "weight", weight, 1, x.shape[-1], "to match x's last dim (K)")
    check_tensor(op, "weight_scale", weight_scale, ndim=1, dtypes=(torch.float32,))
    check_shape(op, "weight_scale", weight_scale, (weight.shape[0],), "(one per output row)")
    if input_scale is not None:
        check_tensor(op, "input_scale", input_scale, dtypes=(torch.float32,))
        if input_scale.numel() != 1:
            raise ValueError(
                f"{op}: input_scale must be per-tensor (one element), got shape "
                f"{tuple(input_scale.shape)}"
            )
    _check_bias(op, x, weight.shape[0], bias)
    check_same_device(
        op, "x", x, weight=weight, weight_scale=weight_scale, input_scale=input_scale, bias=bias
    )
    return get_op(op, x.device)(x, weight, weight_scale, input_scale, bias)


def wna16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b) with W packed as the module docstring says: x [..., K] float; qweight int32
    [N, K * bits / 32]; scales [N, G] and zeros (or None) [N, G] in x's dtype; g_idx None or int32
    [K]; bits 4 or 8; bias [N] in x's dtype or None. Returns [..., N] in x's dtype.

    torch: the weight dequantized to x's dtype, then ``F.linear``. Triton: the weight dequantized
    in the GEMM's K loop (a skinny kernel for a few rows, a tiled one for prefill).
    """
    op = "wna16_linear"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    if is_frag(qweight):
        n = check_frag_weight(op, qweight, scales, zeros, g_idx, bits, x.shape[-1])
    else:
        n = check_wna16_weight(op, qweight, scales, zeros, g_idx, bits, x.shape[-1])
    check_same_dtype(op, "x", x, scales=scales)
    _check_bias(op, x, n, bias)
    check_same_device(op, "x", x, qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx)
    check_same_device(op, "x", x, bias=bias)
    return get_op(op, x.device)(x, qweight, scales, zeros, g_idx, int(bits), bias)


def dequantize_wna16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The float weight [N, K] of a WNA16 layer (layout: the module docstring), in ``dtype``
    (default: the scales' dtype)."""
    op = "dequantize_wna16"
    if bits not in WNA16_BITS:
        raise ValueError(f"{op}: bits must be one of {WNA16_BITS}, got {bits!r}")
    if isinstance(qweight, torch.Tensor) and is_frag(qweight):
        check_frag_weight(op, qweight, scales, zeros, g_idx, bits, qweight.shape[1] * FRAG_STEP)
    else:
        check_tensor(op, "qweight", qweight, ndim=2, dtypes=(torch.int32,))
        k = qweight.shape[1] * 32 // bits
        check_wna16_weight(op, qweight, scales, zeros, g_idx, bits, k)
    check_same_device(op, "qweight", qweight, scales=scales, zeros=zeros, g_idx=g_idx)
    out_dtype = scales.dtype if dtype is None else dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: dtype must be a float dtype, got {dtype!r}")
    return get_op(op, qweight.device)(qweight, scales, zeros, g_idx, int(bits), out_dtype)


def check_wna16_weight(
    op: str,
    qweight: object,
    scales: object,
    zeros: object,
    g_idx: object,
    bits: object,
    k: int,
    names: tuple[str, str, str] = ("qweight", "scales", "zeros"),
    lead: tuple[int, ...] = (),
) -> int:
    """A WNA16 weight for K = ``k`` input features (``names``: the arguments' names in messages;
    ``lead``: leading dims, e.g. (E,) for experts); returns N."""
    q_name, s_name, z_name = names
    if bits not in WNA16_BITS or isinstance(bits, bool):
        raise ValueError(f"{op}: bits must be one of {WNA16_BITS}, got {bits!r}")
    nd = len(lead) + 2
    check_tensor(op, q_name, qweight, ndim=nd, dtypes=(torch.int32,))
    per_int = 32 // bits
    if k % per_int:
        raise ValueError(f"{op}: K = {k} is not a multiple of {per_int} ({bits}-bit values/int32)")
    n = qweight.shape[-2]
    check_shape(
        op, q_name, qweight, (*lead, n, k // per_int),
        f"([{', '.join(['E'] * len(lead) + ['N', f'K * {bits} / 32'])}] for K = {k})",
    )  # fmt: skip
    check_tensor(op, s_name, scales, ndim=nd, dtypes=FLOAT_DTYPES)
    groups = scales.shape[-1]
    check_shape(op, s_name, scales, (*lead, n, groups), "(one scale per row and group)")
    if groups == 0 or (g_idx is None and k % groups):
        raise ValueError(f"{op}: {s_name} has {groups} groups along K = {k}; K must be a multiple")
    if zeros is not None:
        check_tensor(op, z_name, zeros, dtypes=(scales.dtype,))
        check_shape(op, z_name, zeros, tuple(scales.shape), "(to match the scales)")
    if g_idx is not None:
        check_tensor(op, "g_idx", g_idx, ndim=1, dtypes=(torch.int32,))
        check_shape(op, "g_idx", g_idx, (k,), "(one group per input feature)")
    return n


def check_frag_weight(
    op: str,
    qweight: torch.Tensor,
    scales: object,
    zeros: object,
    g_idx: object,
    bits: object,
    k: int,
) -> int:
    """A WNA16 weight in the fragment layout (``ops/int_quant_frag.py``) for K = ``k``; returns
    N."""
    check_tensor(op, "qweight", qweight, ndim=4, dtypes=(torch.int32,))
    if bits != 4 or isinstance(bits, bool):
        raise ValueError(f"{op}: the fragment layout holds 4-bit weights, got bits={bits!r}")
    blocks = qweight.shape[0]
    check_shape(op, "qweight", qweight, (blocks, k // FRAG_STEP, 32, 4),
                f"([N / 16, K / 64, 32, 4] for K = {k}, the fragment layout)")  # fmt: skip
    if k % FRAG_STEP:
        raise ValueError(f"{op}: the fragment layout needs K a multiple of {FRAG_STEP}, got {k}")
    check_tensor(op, "scales", scales, ndim=4, dtypes=FLOAT_DTYPES)
    groups = scales.shape[1]
    check_shape(op, "scales", scales, (blocks, groups, 8, 2), "([N / 16, G, 8, 2])")
    if groups == 0 or (k // FRAG_STEP) % groups:
        raise ValueError(f"{op}: scales has {groups} groups; K / 64 = {k // FRAG_STEP} steps "
                         "must be a multiple")  # fmt: skip
    if zeros is not None:
        check_tensor(op, "zeros", zeros, dtypes=(scales.dtype,))
        check_shape(op, "zeros", zeros, tuple(scales.shape), "(to match the scales)")
    if g_idx is not None:
        raise ValueError(f"{op}: the fragment layout takes no g_idx")
    return blocks * FRAG_ROWS


def _check_bias(op: str, x: torch.Tensor, n: int, bias: torch.Tensor | None) -> None:
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
        check_dim(op, "bias", bias, 0, n, "to match the weight's rows (N)")
        check_same_dtype(op, "x", x, bias=bias)
