"""On the CPU, the engine's unquantized float32 linear layers run on oneDNN-prepacked weights at
the row counts of batched decode (`atom_kernels.backends.cpu.onednn_linear`; its NOTEs have the
measurements), as vLLM's CPU worker prepacks its GEMM weights at load, and those whose K <= N on a
transposed copy at 1 row. Other row counts keep `F.linear`. `ATOM_CPU_PACKED_LINEAR=0` keeps every
layer on `atom_kernels.linear`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from atom_engine import envs

logger = logging.getLogger("atom_engine")

ENV_VAR = "ATOM_CPU_PACKED_LINEAR"  # "0": no packed copies


class OneDnnLinearMethod:
    """A linear layer's quant_method: `onednn_linear.packed_linear` on the layer's packed copy."""

    def create_weights(self, layer: nn.Module) -> None:
        pass

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from atom_kernels.backends.cpu.onednn_linear import packed_linear

        return packed_linear(x, layer.weight, bias, layer.onednn_key)


ONEDNN_LINEAR = OneDnnLinearMethod()


def pack_linears(model: nn.Module, device: torch.device, tp_size: int) -> int:
    """Give every unquantized float32 linear layer of `model` a oneDNN-packed copy of its weight
    (one rank, CPU only); how many layers got one."""
    if device.type != "cpu" or tp_size > 1 or not envs.ATOM_CPU_PACKED_LINEAR:
        return 0
    from atom_kernels.backends.cpu import onednn_linear
    from atom_models.layers.linear import UNQUANTIZED, LinearBase

    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase) or module.quant_method is not UNQUANTIZED:
            continue
        if not onednn_linear.can_pack(module.weight):
            continue
        # The layer holds its packed copy (not a parameter or buffer: never saved or moved).
        module.onednn_key, module.onednn_packed = onednn_linear.pack(module.weight)
        module.onednn_one_row = onednn_linear.pack_one_row(module.onednn_key, module.weight)
        module.quant_method = ONEDNN_LINEAR
        count += 1
    if count:
        logger.info(
            "CPU: %d linear layers run on oneDNN-packed weights at %d-%d rows (%s=0: off)",
            count,
            onednn_linear.MIN_ROWS,
            onednn_linear.MAX_ROWS,
            ENV_VAR,
        )
    return count
