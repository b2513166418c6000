"""Quantization methods: what a quantized linear or expert layer stores and how it computes.

A method is chosen once per layer from the checkpoint's `QuantConfig` (vLLM's shape):
`create_weights(layer)` replaces the layer's float weight (still on `meta`) with its quantized form
and adds the scales, each with a `quant_kind` telling the layer's loader how to shard it;
`process_weights_after_loading(layer)` puts loaded scales into the form the kernels take;
`apply` (linear) / `kernel_args` (experts) computes through `atom_kernels`.
"""

from __future__ import annotations

import torch
from torch import nn

import atom_kernels
from atom_models.layers.linear import UNQUANTIZED, LinearBase
from atom_models.layers.moe import UNQUANTIZED_MOE, FusedMoE
from atom_models.quantization.config import (
    FP8_BLOCK,
    FP8_CHANNEL,
    FP8_TENSOR,
    INT8,
    MXFP4,
    WNA16,
    QuantScheme,
)

FP8 = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _param(shape, dtype, loader, shard_ids, **attrs) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
    param.fixed_dtype = dtype  # materialize() keeps it
    param.weight_loader = loader
    if shard_ids is not None:
        param.shard_ids = list(shard_ids)
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


def _replace(module: nn.Module, name: str, data: torch.Tensor) -> None:
    """Swap a loaded parameter for one holding `data` (its loading attributes kept)."""
    old = getattr(module, name)
    new = nn.Parameter(data, requires_grad=False)
    new.__dict__.update(old.__dict__)
    setattr(module, name, new)


# -- linear layers -------------------------------------------------------------------------------


class Fp8LinearMethod:
    """FP8 weights: block scales (`fp8_block_linear`), or per-channel / per-tensor scales with
    dynamic or static per-tensor activation scales (`fp8_linear`; a per-tensor scale of each
    packed shard becomes that shard's rows' channel scale, exactly)."""

    weight_dtype = FP8

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: LinearBase) -> None:
        scheme, loader = self.scheme, layer.weight_loader
        shard_ids = getattr(layer.weight, "shard_ids", None)
        n, k = layer.output_size, layer.input_size
        layer.weight = _param((n, k), self.weight_dtype, loader, shard_ids)
        if scheme.weight == FP8_BLOCK:
            bn, bk = scheme.block_size
            scale = _param(
                (_cdiv(n, bn), _cdiv(k, bk)),
                torch.float32,
                loader,
                shard_ids,
                quant_kind="block_scale",
                block=(bn, bk),
            )
            self._check_blocks(layer, scale)
        elif scheme.weight == FP8_CHANNEL:
            scale = _param((n,), torch.float32, loader, shard_ids, quant_kind="channel_scale")
        else:
            num = len(shard_ids) if shard_ids else 1
            scale = _param((num,), torch.float32, loader, shard_ids, quant_kind="tensor_scale")
        layer.register_parameter(scheme.scale_name, scale)
        if scheme.static_input_scale:
            num = len(shard_ids) if shard_ids else 1
            layer.input_scale = _param(
                (num,), torch.float32, loader, shard_ids, quant_kind="tensor_scale"
            )

    @staticmethod
    def _check_blocks(layer: LinearBase, scale: nn.Parameter) -> None:
        """Fail before loading when this rank's shards do not fall on weight blocks."""
        bn, bk = scale.block
        for shard_id in getattr(scale, "shard_ids", [None]):
            layer._in_units(
                layer.row_plan(shard_id),
                bn,
                scale.shape[0],
                f"{type(layer).__name__} rows",
                layer.row_padding(shard_id),
            )
        layer._in_units(
            (0, *layer.col_plan()),
            bk,
            scale.shape[1],
            f"{type(layer).__name__} columns",
            layer.col_padding(),
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if getattr(layer, "quant_processed", False):  # hosts may call it again (SGLang)
            return
        layer.quant_processed = True
        if self.scheme.weight == FP8_TENSOR:
            scale = layer.weight_scale.data
            rows = torch.empty(layer.output_size, dtype=torch.float32, device=scale.device)
            shard_ids = getattr(layer.weight_scale, "shard_ids", [None])
            for i, shard_id in enumerate(shard_ids):
                dst, _, count, _ = layer.row_plan(shard_id)
                count += layer.row_padding(shard_id)  # dummy heads: zero weights, any scale
                rows.narrow(0, dst, count).fill_(scale[i])
            _replace(layer, "weight_scale", rows)
        if self.scheme.static_input_scale:
            # One activation scale for the fused layer: the largest of its shards' (as vLLM).
            _replace(layer, "input_scale", layer.input_scale.data.max().reshape(()))

    def dequantized(self, layer: LinearBase, dtype: torch.dtype) -> torch.Tensor:
        if self.scheme.weight == FP8_BLOCK:
            scale = getattr(layer, self.scheme.scale_name)
            return atom_kernels.dequantize_fp8_block(
                layer.weight, scale, self.scheme.block_size, dtype
            )
        return (layer.weight.float() * layer.weight_scale[:, None]).to(dtype)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.scheme.weight == FP8_BLOCK:
            scale = getattr(layer, self.scheme.scale_name)
            return atom_kernels.fp8_block_linear(
                x, layer.weight, scale, self.scheme.block_size, bias
            )
        input_scale = layer.input_scale if self.scheme.static_input_scale else None
        return atom_kernels.fp8_linear(x, layer.weight, layer.weight_scale, input_scale, bias)


def dequantize_linear(layer: LinearBase, dtype: torch.dtype) -> None:
    """Turn a quantized linear layer back into a plain one in `dtype` (a host that reads the
    weight itself, e.g. MLA's kv_b_proj absorbed into attention)."""
    method = layer.quant_method
    if method is UNQUANTIZED:
        return
    weight = method.dequantized(layer, dtype)
    for name in list(layer._parameters):
        if name not in ("weight", "bias"):  # scales, zero points, packed integer weights
            del layer._parameters[name]
    if "weight" not in layer._parameters:  # WNA16 layers hold none
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.weight.weight_loader = layer.weight_loader
    _replace(layer, "weight", weight)
    layer.quant_method = UNQUANTIZED


# -- experts -------------------------------------------------------------------------------------


class Fp8MoEMethod:
    """FP8 experts: block scales ("fp8_block") or per-channel / per-tensor ("fp8_channel")."""

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: FusedMoE) -> None:
        e, i, h = layer.num_experts, layer.intermediate_size, layer.hidden_size
        w13_ids, w2_ids = layer.w13_weight.shard_ids, layer.w2_weight.shard_ids
        layer.w13_weight = _param((e, 2 * i, h), FP8, layer.w13_loader, w13_ids)
        layer.w2_weight = _param((e, h, i), FP8, layer.w2_loader, w2_ids)
        scheme = self.scheme
        name = scheme.scale_name
        if scheme.weight == FP8_BLOCK:
            bn, bk = scheme.block_size
            if i % bn and layer.tp_size > 1 or layer.total_intermediate_size % bn:
                raise ValueError(
                    f"FusedMoE: the expert intermediate size {layer.total_intermediate_size} "
                    f"({i} per rank) is not a multiple of the weight block {bn}"
                )
            shapes = ((e, 2 * i // bn, _cdiv(h, bk)), (e, _cdiv(h, bn), _cdiv(i, bk)))
            attrs = {"quant_kind": "block_scale", "block": (bn, bk)}
        elif scheme.weight == FP8_CHANNEL:
            shapes = ((e, 2 * i), (e, h))
            attrs = {"quant_kind": "channel_scale"}
        else:
            shapes = ((e, 2), (e, 1))
            attrs = {"quant_kind": "tensor_scale"}
        w13_scale = _param(shapes[0], torch.float32, layer.w13_loader, w13_ids, **attrs)
        w2_scale = _param(shapes[1], torch.float32, layer.w2_loader, w2_ids, **attrs)
        layer.register_parameter(f"w13_{name}", w13_scale)
        layer.register_parameter(f"w2_{name}", w2_scale)
        if scheme.static_input_scale:
            attrs = {"quant_kind": "tensor_scale"}
            layer.w13_input_scale = _param(
                (e, 2), torch.float32, layer.w13_loader, w13_ids, **attrs
            )
            layer.w2_input_scale = _param((e, 1), torch.float32, layer.w2_loader, w2_ids, **attrs)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if getattr(layer, "quant_processed", False):  # hosts may call it again (SGLang)
            return
        layer.quant_processed = True
        if self.scheme.weight == FP8_TENSOR:
            i, h = layer.intermediate_size, layer.hidden_size
            w13 = layer.w13_weight_scale.data.repeat_interleave(i, dim=1)  # [E, 2I]
            w2 = layer.w2_weight_scale.data.expand(-1, h).contiguous()  # [E, H]
            _replace(layer, "w13_weight_scale", w13)
            _replace(layer, "w2_weight_scale", w2)
        # Static activation scales are not used: the fused MoE quantizes activations per token.
        for name in ("w13_input_scale", "w2_input_scale"):
            if name in layer._parameters:
                del layer._parameters[name]

    def kernel_args(self, layer: FusedMoE) -> dict:
        name = self.scheme.scale_name
        args = {
            "w13_scale": getattr(layer, f"w13_{name}"),
            "w2_scale": getattr(layer, f"w2_{name}"),
        }
        if self.scheme.weight == FP8_BLOCK:
            return {"quant": "fp8_block", "block_size": self.scheme.block_size, **args}
        return {"quant": "fp8_channel", **args}


class Mxfp4MoEMethod:
    """MXFP4 experts (GPT-OSS): e2m1 pairs packed in uint8 along the input dim, one e8m0 scale
    per 32 values; checkpoints store them [E, out, in] (not transposed, unlike GPT-OSS's bf16
    experts)."""

    def create_weights(self, layer: FusedMoE) -> None:
        e, i, h = layer.num_experts, layer.intermediate_size, layer.hidden_size
        for dim, what in ((h, "hidden size"), (i, "expert intermediate size per rank")):
            if dim % 32:
                raise ValueError(f"FusedMoE (mxfp4): the {what} {dim} is not a multiple of 32")
        w13_ids, w2_ids = layer.w13_weight.shard_ids, layer.w2_weight.shard_ids
        plain = {"checkpoint_transposed": False}
        layer.w13_weight = _param(
            (e, 2 * i, h // 2), torch.uint8, layer.w13_loader, w13_ids, packing=2, **plain
        )
        layer.w2_weight = _param(
            (e, h, i // 2), torch.uint8, layer.w2_loader, w2_ids, packing=2, **plain
        )
        layer.w13_weight_scale = _param(
            (e, 2 * i, h // 32), torch.uint8, layer.w13_loader, w13_ids, packing=32, **plain
        )
        layer.w2_weight_scale = _param(
            (e, h, i // 32), torch.uint8, layer.w2_loader, w2_ids, packing=32, **plain
        )

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def kernel_args(self, layer: FusedMoE) -> dict:
        return {
            "quant": "mxfp4",
            "w13_scale": layer.w13_weight_scale,
            "w2_scale": layer.w2_weight_scale,
        }


def linear_method(scheme: QuantScheme):
    from atom_models.quantization.int_methods import Int8LinearMethod, Wna16LinearMethod

    if scheme.weight in (FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR):
        return Fp8LinearMethod(scheme)
    if scheme.weight == INT8:
        return Int8LinearMethod(scheme)
    if scheme.weight == WNA16:
        return Wna16LinearMethod(scheme)
    raise ValueError(f"linear layers cannot be stored as {scheme.weight!r}")


def moe_method(scheme: QuantScheme):
    from atom_models.quantization.int_methods import Wna16MoEMethod

    if scheme.weight == MXFP4:
        return Mxfp4MoEMethod()
    if scheme.weight == WNA16:
        return Wna16MoEMethod(scheme)
    if scheme.weight == INT8:
        raise ValueError(
            "quantization_config: W8A8 int8 experts are not supported (fused_moe has no int8 "
            "path); ATOM loads int8 linear layers, and WNA16 (4/8-bit weight-only) experts"
        )
    return Fp8MoEMethod(scheme)


__all__ = ["UNQUANTIZED", "UNQUANTIZED_MOE", "dequantize_linear", "linear_method", "moe_method"]
