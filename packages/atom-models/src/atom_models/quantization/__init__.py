"""Quantized checkpoints: the format read from config.json, applied to a model's layers.

`build_model` calls `quantize_model` on the model (still on `meta`): every linear and expert layer
the checkpoint quantizes gets its quantization method, which swaps in the quantized parameters;
routers, embeddings, the LM head, norms, the modules the config leaves out and linear layers marked
`quantizable = False` keep the activation dtype. After the weights are loaded,
`process_weights_after_loading` finishes each layer.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_models.layers.linear import LinearBase
from atom_models.layers.moe import FusedMoE
from atom_models.quantization.config import (
    SUPPORTED,
    QuantConfig,
    QuantScheme,
    parse_quant_config,
    quantization_config_of,
)
from atom_models.quantization.methods import dequantize_linear, linear_method, moe_method

ROUTER_NAMES = ("gate", "router")


def quantize_model(model: nn.Module, quant_config: QuantConfig | None, dtype: torch.dtype) -> None:
    """Give each quantized layer of `model` (built on `meta`) its method and parameters."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (LinearBase, FusedMoE)):
            module.params_dtype = dtype
        if quant_config is None:
            continue
        if isinstance(module, LinearBase):
            if _is_router(model, name) or not getattr(module, "quantizable", True):
                continue  # not quantizable: e.g. the MTP layers' eh_proj
            scheme = quant_config.linear_scheme(checkpoint_names(model, name))
            if scheme is None:
                continue
            method = linear_method(scheme)
        elif isinstance(module, FusedMoE):
            scheme = quant_config.moe_scheme(name, expert_checkpoint_names(model, name))
            if scheme is None:
                continue
            method = moe_method(scheme)
        else:
            continue
        method.create_weights(module)
        module.quant_method = method


def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
        if isinstance(module, LinearBase) and getattr(module, "dense_weight_required", False):
            dequantize_linear(module, module.params_dtype)


def _is_router(model: nn.Module, name: str) -> bool:
    """An MoE router (a `gate` / `router` beside the experts): always in the activation dtype."""
    parent_name, _, leaf = name.rpartition(".")
    if leaf not in ROUTER_NAMES:
        return False
    parent = model.get_submodule(parent_name) if parent_name else model
    return any(isinstance(child, FusedMoE) for child in parent.children())


def checkpoint_names(model: nn.Module, name: str) -> list[str]:
    """The checkpoint module names a layer loads from: its own, or those packed into it
    (`...self_attn.qkv_proj` -> `...self_attn.q_proj`, `k_proj`, `v_proj`)."""
    mapping = getattr(model, "packed_modules_mapping", {})
    names = []
    for ckpt_part, (param_part, _) in mapping.items():
        if name == param_part or name.endswith("." + param_part):
            names.append(name[: len(name) - len(param_part)] + ckpt_part)
    return names or [name]


def expert_checkpoint_names(model: nn.Module, name: str) -> list[str]:
    """The checkpoint modules of the FusedMoE `name`'s first expert (`...experts.0.gate_proj`,
    `up_proj`, `down_proj`), as the model's mapping routes them; [name] without a mapping."""
    mapping = getattr(model, "packed_modules_mapping", {})
    names = []
    for ckpt_part, (param_part, shard) in mapping.items():
        if not (isinstance(shard, tuple) and shard[0] == 0 and ckpt_part.endswith(".weight")):
            continue
        param_module = param_part.rpartition(".")[0]
        if name == param_module or name.endswith("." + param_module):
            prefix = name[: len(name) - len(param_module)]
            names.append(prefix + ckpt_part[: -len(".weight")])
    return sorted(set(names)) or [name]


__all__ = [
    "SUPPORTED",
    "QuantConfig",
    "QuantScheme",
    "checkpoint_names",
    "expert_checkpoint_names",
    "parse_quant_config",
    "process_weights_after_loading",
    "quantization_config_of",
    "quantize_model",
]
