"""The Triton quantization ops as torch custom ops ("atom::triton_<op>") with fake (meta)
implementations, registered as the registry's ``triton`` entries through ``custom_ops``' router
(the custom op under torch.compile, the host code directly in eager code)."""

from __future__ import annotations

import torch

from atom_kernels.backends.triton import int_quant, quant
from atom_kernels.backends.triton.custom_ops import _router
from atom_kernels.ops.int_quant_frag import frag_shape
from atom_kernels.registry import register_op


@torch.library.custom_op(
    "atom::triton_dequantize_fp8_block",
    mutates_args=(),
    schema="(Tensor weight, Tensor scale, int[] block_size, ScalarType dtype) -> Tensor",
)
def dequantize_fp8_block(weight, scale, block_size, dtype):
    return quant.dequantize_fp8_block(weight, scale, tuple(block_size), dtype)


@dequantize_fp8_block.register_fake
def _(weight, scale, block_size, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)


@torch.library.custom_op(
    "atom::triton_dequantize_mxfp4",
    mutates_args=(),
    schema="(Tensor blocks, Tensor scales, ScalarType dtype) -> Tensor",
)
def dequantize_mxfp4(blocks, scales, dtype):
    return quant.dequantize_mxfp4(blocks, scales, dtype)


@dequantize_mxfp4.register_fake
def _(blocks, scales, dtype):
    return blocks.new_empty((*blocks.shape[:-2], blocks.shape[-2] * 32), dtype=dtype)


@torch.library.custom_op(
    "atom::triton_per_token_group_quant_fp8",
    mutates_args=(),
    schema="(Tensor x, int group_size) -> (Tensor, Tensor)",
)
def per_token_group_quant_fp8(x, group_size):
    return quant.per_token_group_quant_fp8(x, group_size)


@per_token_group_quant_fp8.register_fake
def _(x, group_size):
    num_rows, num_cols = x.shape
    groups = -(-num_cols // group_size)
    return (
        x.new_empty((num_rows, num_cols), dtype=quant.FP8_DTYPE),
        x.new_empty((num_rows, groups), dtype=torch.float32),
    )


@torch.library.custom_op(
    "atom::triton_fp8_block_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor scale, int[] block_size, Tensor? bias) -> Tensor",
)
def fp8_block_linear(x, weight, scale, block_size, bias):
    return quant.fp8_block_linear(x, weight, scale, tuple(block_size), bias)


@fp8_block_linear.register_fake
def _(x, weight, scale, block_size, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(
    "atom::triton_fp8_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias) "
    "-> Tensor",
)
def fp8_linear(x, weight, weight_scale, input_scale, bias):
    return quant.fp8_linear(x, weight, weight_scale, input_scale, bias)


@fp8_linear.register_fake
def _(x, weight, weight_scale, input_scale, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(
    "atom::triton_int8_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias) "
    "-> Tensor",
)
def int8_linear(x, weight, weight_scale, input_scale, bias):
    return int_quant.int8_linear(x, weight, weight_scale, input_scale, bias)


@int8_linear.register_fake
def _(x, weight, weight_scale, input_scale, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(
    "atom::triton_wna16_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? g_idx, int bits, "
    "Tensor? bias) -> Tensor",
)
def wna16_linear(x, qweight, scales, zeros, g_idx, bits, bias):
    return int_quant.wna16_linear(x, qweight, scales, zeros, g_idx, bits, bias)


@wna16_linear.register_fake
def _(x, qweight, scales, zeros, g_idx, bits, bias):
    return x.new_empty((*x.shape[:-1], frag_shape(qweight, bits)[0]))


@torch.library.custom_op(
    "atom::triton_dequantize_wna16",
    mutates_args=(),
    schema="(Tensor qweight, Tensor scales, Tensor? zeros, Tensor? g_idx, int bits, "
    "ScalarType dtype) -> Tensor",
)
def dequantize_wna16(qweight, scales, zeros, g_idx, bits, dtype):
    return int_quant.dequantize_wna16(qweight, scales, zeros, g_idx, bits, dtype)


@dequantize_wna16.register_fake
def _(qweight, scales, zeros, g_idx, bits, dtype):
    return qweight.new_empty(frag_shape(qweight, bits), dtype=dtype)


ENTRIES = {
    name: _router(name, traced, direct)
    for name, (traced, direct) in {
        "dequantize_fp8_block": (dequantize_fp8_block, quant.dequantize_fp8_block),
        "dequantize_mxfp4": (dequantize_mxfp4, quant.dequantize_mxfp4),
        "per_token_group_quant_fp8": (per_token_group_quant_fp8, quant.per_token_group_quant_fp8),
        "fp8_block_linear": (fp8_block_linear, quant.fp8_block_linear),
        "fp8_linear": (fp8_linear, quant.fp8_linear),
        "int8_linear": (int8_linear, int_quant.int8_linear),
        "wna16_linear": (wna16_linear, int_quant.wna16_linear),
        "dequantize_wna16": (dequantize_wna16, int_quant.dequantize_wna16),
    }.items()
}
for _name, _entry in ENTRIES.items():
    register_op(_name, "triton")(_entry)
