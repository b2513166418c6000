"""Integer-quantized layers: W8A8 linear layers (`atom_kernels.int8_linear`) and WNA16 linear
layers and experts (`atom_kernels.wna16_linear`, `fused_moe(quant="wna16")`).

A WNA16 layer registers its checkpoint's own tensors under their checkpoint names (`qweight`,
`scales`, `qzeros`, `g_idx`; `weight_packed`, `weight_scale`, ...), each marked with the role it
plays; the loaders repack each checkpoint tensor into the one in-memory layout as it is read
(`atom_models.layers.int_checkpoint`), so loading holds at most one tensor's temporaries.
`process_weights_after_loading` turns zero points into the scales' dtype (dropping symmetric
ones) and drops what the kernels do not read.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import atom_kernels
from atom_kernels.ops.int_quant_frag import frag_fits, frag_preferred, wna16_to_frag
from atom_models.layers.int_checkpoint import TENSOR_NAMES
from atom_models.layers.linear import LinearBase
from atom_models.layers.moe import FusedMoE
from atom_models.quantization.config import FP8_CHANNEL, FP8_TENSOR, QuantScheme
from atom_models.quantization.methods import Fp8LinearMethod, _cdiv, _param, _replace


class Int8LinearMethod(Fp8LinearMethod):
    """int8 weights with a scale per channel or per tensor (one per shard of a packed layer,
    made per row after loading), activations quantized to int8 per token or by a static
    per-tensor `input_scale`: compressed-tensors W8A8."""

    weight_dtype = torch.int8

    def __init__(self, scheme: QuantScheme) -> None:
        super().__init__(
            dataclasses.replace(scheme, weight=FP8_CHANNEL if scheme.channel_scale else FP8_TENSOR)
        )

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        input_scale = layer.input_scale if self.scheme.static_input_scale else None
        return atom_kernels.int8_linear(x, layer.weight, layer.weight_scale, input_scale, bias)


def _int_attrs(scheme: QuantScheme, role: str, **extra) -> dict:
    return {
        "int_role": role,
        "int_format": scheme.checkpoint,
        "bits": scheme.bits,
        **extra,
    }


def _zeros_to_float(module: nn.Module, name: str, scheme: QuantScheme, dtype) -> None:
    """Checkpoint zero points (int32, unsigned) -> the scales' dtype; symmetric ones (all
    2**(bits - 1), as GPTQ stores them) are dropped: the kernels' default."""
    zeros = module._parameters.get(name)
    if zeros is None:
        return
    if scheme.symmetric and bool((zeros.data == 1 << (scheme.bits - 1)).all()):
        del module._parameters[name]
        return
    _replace(module, name, zeros.data.to(dtype))


class Wna16LinearMethod:
    """4/8-bit weights packed in int32, a scale (and zero point) per group of input features."""

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme
        self.names = TENSOR_NAMES[scheme.checkpoint]

    def create_weights(self, layer: LinearBase) -> None:
        scheme, loader = self.scheme, layer.weight_loader
        shard_ids = getattr(layer.weight, "shard_ids", None)
        n, k = layer.output_size, layer.input_size
        per_int = 32 // scheme.bits
        if k % per_int:
            raise ValueError(
                f"{type(layer).__name__}: {k} input features per rank are not a multiple of "
                f"{per_int} ({scheme.bits}-bit values per int32)"
            )
        total_k = layer.col_plan()[2]
        group = scheme.group_size
        if group == -1:
            num_groups, unit = 1, 0
        elif scheme.g_idx:  # any input feature may be in any group: every rank holds all groups
            num_groups, unit = _cdiv(total_k, group), 0
        else:
            num_groups, unit = _cdiv(k, group), group
        del layer._parameters["weight"]
        names = self.names

        def add(role, shape, dtype, **extra):
            param = _param(
                shape,
                dtype,
                loader,
                shard_ids,
                quant_kind="int",
                **_int_attrs(scheme, role, **extra),
            )
            layer.register_parameter(names.get(role, role), param)

        add("qweight", (n, k // per_int), torch.int32, col_unit=per_int)
        add("scales", (n, num_groups), layer.params_dtype, col_unit=unit)
        if not scheme.symmetric or scheme.checkpoint in ("gptq", "gptq_v2"):  # GPTQ stores them
            add("zeros", (n, num_groups), torch.int32, col_unit=unit)
        if scheme.g_idx or scheme.checkpoint in ("gptq", "gptq_v2"):  # GPTQ stores g_idx always
            add("g_idx", (k,), torch.int32, col_unit=1)
        if scheme.checkpoint == "ct":
            add("shape", (1,), torch.int64)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if getattr(layer, "quant_processed", False):  # hosts may call it again (SGLang)
            return
        layer.quant_processed = True
        scales = getattr(layer, self.names["scales"])
        _zeros_to_float(layer, self.names["zeros"], self.scheme, scales.dtype)
        if not self.scheme.g_idx:
            layer._parameters.pop(self.names.get("g_idx", "g_idx"), None)
        layer._parameters.pop("weight_shape", None)
        self._to_frag(layer)

    def _to_frag(self, layer: LinearBase) -> None:
        """On an NVIDIA GPU (``ATOM_WNA16_FRAG``), a fitting weight repacked in place into the
        fragment layout its decode kernel reads (``atom_kernels.ops.int_quant_frag``: the same
        bytes permuted; one tensor's copy at a time)."""
        qweight, scales, zeros, g_idx = self._tensors(layer)
        n, k = qweight.shape[0], qweight.shape[1] * 32 // self.scheme.bits
        group = k // scales.shape[1]
        if not frag_preferred(qweight.device, scales.dtype) or frag_fits(
            n, k, group, self.scheme.bits, g_idx is not None
        ):
            return
        packed = wna16_to_frag(qweight, scales, zeros)
        for name, tensor in zip(("qweight", "scales", "zeros"), packed, strict=True):
            if tensor is not None:
                _replace(layer, self.names.get(name, name), tensor)

    def _tensors(self, layer: LinearBase):
        names = self.names
        return (
            getattr(layer, names["qweight"]),
            getattr(layer, names["scales"]),
            layer._parameters.get(names["zeros"]),
            layer._parameters.get(names.get("g_idx", "g_idx")),
        )

    def dequantized(self, layer: LinearBase, dtype: torch.dtype) -> torch.Tensor:
        return atom_kernels.dequantize_wna16(*self._tensors(layer), self.scheme.bits, dtype)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return atom_kernels.wna16_linear(x, *self._tensors(layer), self.scheme.bits, bias)


class Wna16MoEMethod:
    """WNA16 experts, stacked per expert into `fused_moe(quant="wna16")`'s layout."""

    def __init__(self, scheme: QuantScheme) -> None:
        if scheme.g_idx:
            raise ValueError(
                "quantization_config: act-order groups (GPTQ desc_act, compressed-tensors "
                "actorder 'group') in experts are not supported: fused_moe takes contiguous "
                "groups; ATOM loads them in linear layers"
            )
        self.scheme = scheme
        self.names = TENSOR_NAMES[scheme.checkpoint]

    def create_weights(self, layer: FusedMoE) -> None:
        scheme, names = self.scheme, self.names
        e, i, h = layer.num_experts, layer.intermediate_size, layer.hidden_size
        per_int = 32 // scheme.bits
        for dim, what in ((h, "hidden size"), (i, "expert intermediate size per rank")):
            if dim % per_int:
                raise ValueError(
                    f"FusedMoE (wna16): the {what} {dim} is not a multiple of {per_int}"
                )
        w13_ids, w2_ids = layer.w13_weight.shard_ids, layer.w2_weight.shard_ids
        del layer._parameters["w13_weight"], layer._parameters["w2_weight"]
        group = scheme.group_size
        for prefix, rows, cols, loader, ids in (
            ("w13", 2 * i, h, layer.w13_loader, w13_ids),
            ("w2", h, i, layer.w2_loader, w2_ids),
        ):

            def add(role, shape, dtype, prefix=prefix, loader=loader, ids=ids, **extra):
                attrs = _int_attrs(scheme, role, **extra)
                param = _param(shape, dtype, loader, ids, **attrs)
                layer.register_parameter(f"{prefix}_{names.get(role, role)}", param)

            add("qweight", (e, rows, cols // per_int), torch.int32, packing=per_int)
            if group == -1:
                grid, kind = {"quant_kind": "channel_scale"}, (e, rows)
            else:
                if cols % group:
                    raise ValueError(
                        f"FusedMoE (wna16): {cols} input features per rank of "
                        f"{prefix} are not a multiple of the group size {group}"
                    )
                grid = {"quant_kind": "block_scale", "block": (1, group)}
                kind = (e, rows, cols // group)
            add("scales", kind, layer.params_dtype, **grid)
            if not scheme.symmetric or scheme.checkpoint in ("gptq", "gptq_v2"):
                add("zeros", kind, torch.int32, **grid)
            if scheme.checkpoint in ("gptq", "gptq_v2"):  # contiguous groups: checked, not kept
                add("g_idx", (1,), torch.int32, quant_kind="int", group_size=group)
            if scheme.checkpoint == "ct":
                add("shape", (1,), torch.int64, quant_kind="int")

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if getattr(layer, "quant_processed", False):
            return
        layer.quant_processed = True
        names = self.names
        for prefix in ("w13", "w2"):
            scales = getattr(layer, f"{prefix}_{names['scales']}")
            if scales.dim() == 2:  # channel-wise: one group
                _replace(layer, f"{prefix}_{names['scales']}", scales.data.unsqueeze(-1))
                zeros = layer._parameters.get(f"{prefix}_{names['zeros']}")
                if zeros is not None:
                    _replace(layer, f"{prefix}_{names['zeros']}", zeros.data.unsqueeze(-1))
            _zeros_to_float(layer, f"{prefix}_{names['zeros']}", self.scheme, scales.dtype)
            layer._parameters.pop(f"{prefix}_g_idx", None)
            layer._parameters.pop(f"{prefix}_weight_shape", None)

    def kernel_args(self, layer: FusedMoE) -> dict:
        names = self.names
        return {
            "quant": "wna16",
            "w13_scale": getattr(layer, f"w13_{names['scales']}"),
            "w2_scale": getattr(layer, f"w2_{names['scales']}"),
            "w13_zeros": layer._parameters.get(f"w13_{names['zeros']}"),
            "w2_zeros": layer._parameters.get(f"w2_{names['zeros']}"),
        }

    def expert_weights(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
        names = self.names
        return getattr(layer, f"w13_{names['qweight']}"), getattr(layer, f"w2_{names['qweight']}")
